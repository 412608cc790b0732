"""torch.distributed plumbing of the broadcast: the group, bounded waits, worker threads.

The group is a stateless ``ProcessGroupNCCL``/``ProcessGroupGloo`` over its own ``TCPStore``
(rank 0, the trainer, hosts it): nothing calls ``torch.distributed.init_process_group``, so
the trainer's own groups are never disturbed. Every wait here is bounded: a peer that dies
mid-collective costs a timeout, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..errors import WeightSyncTimeout
from .wire import GroupInfo

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """A process group and the store it lives on (the store must outlive the group)."""

    pg: Any
    store: Any

    def broadcast(self, buf: torch.Tensor, timeout: float, *, wait: bool = True) -> Any:
        """Broadcast ``buf`` from rank 0.

        CPU (gloo): blocks until done or ``timeout``. GPU (NCCL): enqueues and makes the current
        stream wait for it (no host block; use :func:`wait_stream` for a bounded host wait).
        """
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([buf], opts)
        if buf.device.type == "cuda":
            if wait:
                work.wait()  # stream-level: later work on this stream sees the data
        elif wait and not work.wait(timedelta(seconds=timeout)):
            raise WeightSyncTimeout(f"broadcast of {buf.numel()} bytes did not finish within {timeout}s (timeout)")
        return work

    def broadcast_many(self, bufs: list[torch.Tensor], timeout: float, *, coalesce: bool) -> Any:
        """Broadcast each of ``bufs`` from rank 0, as one coalesced NCCL group when
        ``coalesce`` (every rank must group the same tensors the same way).

        GPU: enqueued; returns the work to wait on (stream-level). CPU: each finishes (bounded)
        before this returns.
        """
        if not bufs:
            return None
        if bufs[0].device.type != "cuda":
            for b in bufs:
                self.broadcast(b, timeout)
            return None
        # As little Python per tensor as possible: every collective call releases the GIL and
        # must win it back from the engine's busy thread (one options object, bound method).
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        bcast = self.pg.broadcast
        if not coalesce or len(bufs) == 1:
            work = None
            for b in bufs:
                work = bcast([b], opts)
            return work
        self.pg._start_coalescing()
        try:
            for b in bufs:
                bcast([b], opts)
        finally:
            work = self.pg._end_coalescing()
        return work

    def prove(self, device: torch.device, timeout: float) -> None:
        """One tiny collective: every rank is there (NCCL connects lazily)."""
        buf = torch.zeros(1, dtype=torch.uint8, device=device)
        self.broadcast(buf, timeout)
        if buf.device.type == "cuda":
            wait_stream(buf.device, timeout)

    def abort(self, timeout: float = 10.0) -> None:
        """Abort the group's communicators (unblocks peers stuck in a collective), at most
        ``timeout`` seconds: it runs in a daemon thread, so it can never hang the caller."""
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if fn is not None:
            t = threading.Thread(target=_quiet, args=(fn,), daemon=True, name="rollq-group-abort")
            t.start()
            t.join(timeout)

    def destroy(self, timeout: float = 10.0) -> None:
        """Abort the group and drop it (rank 0, after a failure). On gloo only freeing the
        process group closes its connections, which ends the peers' pending receives at once
        (an abort alone leaves them waiting for their timeout); the caller must hold no other
        reference to it (a failed collective's work or traceback keeps it alive)."""
        self.abort(timeout)
        self.pg = self.store = None


def _quiet(fn: Any) -> None:
    try:
        fn()
    except Exception as e:
        log.debug("aborting a weight broadcast group: %s", e)


def make_group(info: GroupInfo, rank: int, device: torch.device | None = None) -> Group:
    """A stateless process group of ``info`` (rank 0 hosts the TCPStore)."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=info.timeout)
    store = TCPStore(info.host, info.port, info.world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    pstore = PrefixStore(f"rollq/{info.id}", store)
    if info.backend == "gloo":
        pg = torch.distributed.ProcessGroupGloo(pstore, rank, info.world_size, timeout)
    else:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # The receivers share their GPU with a busy engine: a high-priority stream gets the
        # broadcast's blocks scheduled ahead of the engine's queued kernels as SMs free up,
        # and more channels keep the transfer at NVLink speed while decoding loads HBM.
        opts.is_high_priority_stream = True
        if info.min_ctas > 0 and not any(k in os.environ for k in ("NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS")):
            os.environ["NCCL_MIN_NCHANNELS"] = str(info.min_ctas)
        pg = torch.distributed.ProcessGroupNCCL(pstore, rank, info.world_size, opts)
    return Group(pg, store)


def wait_stream(device: torch.device, timeout: float, what: str = "broadcast") -> None:
    """Wait for the current CUDA stream, at most ``timeout`` seconds (never hang forever)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            raise WeightSyncTimeout(f"{what} did not finish within {timeout}s (timeout)")
        time.sleep(0.0002)


def in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Run ``fn(*args)`` in a daemon thread; an awaitable of its result.

    Unlike ``asyncio.to_thread`` the thread is not in the loop's executor, so a call stuck
    inside a collective (bounded by our own timeouts, but a native call may still block)
    can never hold up the event loop's shutdown.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def done(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def run() -> None:
        try:
            r = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
                loop.call_soon_threadsafe(done, False, e)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done, True, r)

    threading.Thread(target=run, daemon=True, name="rollq-broadcast").start()
    return fut


_gil_users = 0
_gil_lock = threading.Lock()
_gil_saved = 0.005


@contextlib.contextmanager
def responsive_gil(interval: float | None = None) -> Any:
    """Shorten the interpreter's GIL switch interval while a weight-sync thread works.

    The thread shares its process with vLLM's busy engine loop; at the default 5 ms every
    one of its hundreds of small steps (one per tensor) can wait that long for the GIL.
    Restored when the last user leaves. ``interval`` defaults to ``ROLLQ_GIL_SWITCH_INTERVAL``
    (seconds), else 0.2 ms (benchmarks/README.md, ``gil_roundtrips.py``, has the costs).
    """
    if interval is None:
        interval = float(os.environ.get("ROLLQ_GIL_SWITCH_INTERVAL", "0.0002"))

    global _gil_users, _gil_saved
    with _gil_lock:
        if _gil_users == 0:
            _gil_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, _gil_saved))
        _gil_users += 1
    try:
        yield
    finally:
        with _gil_lock:
            _gil_users -= 1
            if _gil_users == 0:
                sys.setswitchinterval(_gil_saved)
