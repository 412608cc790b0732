"""vLLM's processes end with the process that started them.

``AsyncLLM`` runs its engine core in a child process, which runs each worker in a child of
its own (spawned: vLLM's CPU backend and CUDA force ``spawn``). When the replica is
SIGKILLed (an OOM kill, a supervisor's forced stop), nothing ends them: vLLM's workers read
a "death pipe" from the engine core, but the engine core has no such watch on its own
parent, so it stays up, and its worker with it, holding the model and the KV cache.

:func:`install`, called in the replica before the engine is built, makes vLLM start its
engine core through :func:`_engine_core_main`, which starts :func:`watch_parent` and makes
the workers that engine core starts watch it in turn (:func:`_worker_main`). The watch is a
daemon thread that polls ``os.getppid()``: it changes when the parent dies, whatever killed
it, whichever thread started the child and whichever start method was used (``prctl``'s
``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends, and the replica
builds its engine in a worker thread). When the parent is gone the process asks vLLM's own
shutdown to run (SIGTERM), ends its descendants, and is SIGKILLed after :data:`GRACE_S`.

The two ``*_main`` functions run inside vLLM's processes; they are module-level functions so
``spawn`` pickles them by name and the child imports this module. A vLLM without the
expected entry points is left as it is (logged once).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["install", "watch_parent"]

#: Seconds between two looks at the parent pid.
POLL_S = 0.25
#: Seconds vLLM's own shutdown gets, once the parent is gone, before SIGKILL.
GRACE_S = 5.0

_SAVED = "_rollq_unwatched_"


def install() -> bool:
    """Make the engine-core processes vLLM starts from now on (in this process) end with
    this process, and their workers with them. Returns whether this vLLM could be hooked."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        logger.warning("this vLLM has no vllm.v1.engine.core.EngineCoreProc: its engine core will not "
                       "end with the replica if the replica is killed")
        return False
    return _wrap(EngineCoreProc, "run_engine_core", _engine_core_main)


def _wrap(cls: type, name: str, main: Callable[..., Any]) -> bool:
    """Replace the static method ``cls.name`` (a process entry point) by ``main``, which
    calls the saved original."""
    current = cls.__dict__.get(name)
    fn = current.__func__ if isinstance(current, staticmethod) else current
    if fn is main:
        return True
    if not callable(fn):
        logger.warning("vLLM's %s.%s is not a static method; its processes will not end with their parent",
                       cls.__name__, name)
        return False
    setattr(cls, _SAVED + name, staticmethod(fn))
    setattr(cls, name, staticmethod(main))
    return True


def _original(cls: type, name: str) -> Callable[..., Any]:
    """vLLM's own entry point: the one :func:`_wrap` saved (inherited by a forked child), or
    the class's (a spawned child imported vLLM afresh)."""
    fn = cls.__dict__.get(_SAVED + name) or cls.__dict__[name]
    return fn.__func__ if isinstance(fn, staticmethod) else fn


def _engine_core_main(*args: Any, **kwargs: Any) -> Any:
    """``EngineCoreProc.run_engine_core`` with a parent watch; its workers watch it."""
    from vllm.v1.engine.core import EngineCoreProc

    watch_parent("vLLM engine core")
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc

        _wrap(WorkerProc, "worker_main", _worker_main)
    except ImportError:  # another executor (Ray, uniproc): no worker processes of ours
        pass
    return _original(EngineCoreProc, "run_engine_core")(*args, **kwargs)


def _worker_main(*args: Any, **kwargs: Any) -> Any:
    """``WorkerProc.worker_main`` with a parent watch (vLLM's death pipe only asks a worker
    to stop, which one busy in a long call does not see)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    watch_parent("vLLM worker")
    return _original(WorkerProc, "worker_main")(*args, **kwargs)


def watch_parent(what: str) -> threading.Thread:
    """Start the daemon thread that ends this process (``what``, for the log) and its
    descendants once its parent is gone."""
    parent = multiprocessing.parent_process()
    ppid = parent.pid if parent is not None and parent.pid else os.getppid()
    t = threading.Thread(target=_watch, args=(ppid, what), name="rollq-parent-watch", daemon=True)
    t.start()
    return t


def _watch(ppid: int, what: str) -> None:
    while os.getppid() == ppid:
        time.sleep(POLL_S)
    logger.error("%s (pid %d): its parent (pid %d) is gone; ending it and its children", what, os.getpid(), ppid)
    _end_tree()


def _end_tree() -> None:
    """SIGTERM this process (vLLM's shutdown path) and its descendants; SIGKILL whatever is
    left after :data:`GRACE_S`."""
    import psutil

    deadline = time.monotonic() + GRACE_S
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        kids = []
    for p in kids:
        try:
            p.terminate()
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGTERM)
    _, alive = psutil.wait_procs(kids, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    time.sleep(max(0.0, deadline - time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)
