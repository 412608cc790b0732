"""An RL run's replicas in a process of their own, driven from the trainer's process.

:class:`~rollq.rl.replicas.Replicas` runs every replica's vLLM front end, consumer and weight
follower in the caller's process and event loop. Beside a trainer that is one interpreter for
both: a GRPO step of a few thousand PyTorch operators gives up the interpreter lock around each
one and waits to take it back while the event loop serves the replicas (a thread holding the
lock a fifth of the time made the step 1.43x slower on an H100,
``benchmarks/step_contention.py``). A deployment runs its replicas apart (``rollq consume``);
:class:`ReplicasProcess` does the same for one machine's RL run: the same calls as
:class:`~rollq.rl.replicas.Replicas` (``start``, ``attach``, ``detach``, ``wait_version``,
``snapshot``, ``stop``), answered by a child process (``python -m rollq.rl._host_main``)
over a Unix socket in :mod:`rollq.rl.host_wire`'s messages.

>>> async with ReplicasProcess(url, "grpo", weights_root=root, count=1) as rs:   # doctest: +SKIP
...     await rs.attach("rl-run-2")
...     print((await rs.snapshot()).versions)
[0]

The child inherits the environment (CUDA MPS's pipe folder, ``VLLM_*``), writes its logs to
the parent's stderr, and stops its replicas and exits when the trainer's side closes the
socket (or dies). :meth:`ReplicasProcess.stop` stops only the process it started, by pid:
the ``Stop`` call, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from ..errors import ProtocolError, RollqError
from .host_wire import (
    Attach, Call, Detach, HostConfig, Reply, Snapshot, Stop, WaitVersion, decode_call, decode_config, decode_reply, encode,
    frame, read_frame,
)
from .replicas import ReplicaSnapshot, Replicas, StartedReplicas

log = logging.getLogger(__name__)

__all__ = ["ReplicaHostError", "ReplicasProcess"]


class ReplicaHostError(RollqError):
    """The replicas' host process failed a call, did not start, or is gone; the message says which."""


class ReplicasProcess(StartedReplicas):
    """``count`` replicas of one queue in a child process (see the module doc); the arguments
    are :class:`~rollq.rl.replicas.Replicas`' and ``pin``, the cores the child confines itself
    to (None: no pinning). ``start_timeout`` bounds the engines' start, ``call_timeout`` every
    other call (``wait_version`` also by its own timeout)."""

    def __init__(self, url: str, queue: str, *, weights_root: str | None, pin: list[int] | None = None,
                 start_timeout: float = 900.0, call_timeout: float = 300.0, **replicas: Any):
        if replicas.get("engine", "vllm") not in ("vllm", "echo"):
            raise ValueError(f"engine must be 'vllm' or 'echo', got {replicas['engine']!r}")
        self.config = HostConfig(url=url, queue=queue, weights_root=weights_root, pin=pin,
                                 log_level=logging.getLogger().getEffectiveLevel(), **replicas)
        self.queue = queue
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        #: Seconds the engines took to start (the child's figure) and the model they serve.
        self.start_s, self.model = 0.0, replicas.get("model")
        #: The child's pid while it runs.
        self.pid: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._dir: str | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> Self:
        """Start the child, its engines and its replicas on :attr:`queue`; returns once they
        serve. A start that fails stops the child before it raises."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rollq-host-")
        path = str(Path(self._dir) / "sock")
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if connected.done():  # one peer only: the child this object started
                writer.close()
            else:
                connected.set_result((reader, writer))

        server = await asyncio.start_unix_server(on_connect, path)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollq.rl._host_main", path, stdin=asyncio.subprocess.DEVNULL, env=_child_env())
            self.pid = self._proc.pid
            self._reader, self._writer = await self._until_child(connected, self.start_timeout, "connect")
        finally:
            server.close()
        reply = await self._exchange(encode(self.config), self.start_timeout, "start")
        snap = reply.snapshot or ReplicaSnapshot()
        self.start_s, self.model = snap.start_s, snap.model or self.model
        log.info("replica host pid %d: %d %s replica(s) up in %.1fs", self.pid, self.config.count, self.config.engine, self.start_s)

    async def attach(self, queue: str, weights_root: str | None = None, *, abort_resume: bool = False) -> None:
        """:meth:`~rollq.rl.replicas.Replicas.attach`, in the child."""
        await self._call(Attach(queue=queue, weights_root=weights_root, abort_resume=abort_resume))
        self.queue = queue

    async def detach(self) -> None:
        """:meth:`~rollq.rl.replicas.Replicas.detach`, in the child."""
        await self._call(Detach())

    async def wait_version(self, version: int, timeout: float = 120.0) -> None:
        """Until every replica serves ``version`` or newer (TimeoutError after ``timeout``)."""
        await self._call(WaitVersion(version=version, timeout=timeout), timeout=timeout + self.call_timeout)

    async def snapshot(self) -> ReplicaSnapshot:
        """:meth:`~rollq.rl.replicas.Replicas.snapshot`, read in the child."""
        return (await self._call(Snapshot())).snapshot or ReplicaSnapshot()

    async def stop(self, grace: float = 60.0) -> None:
        """Stop the replicas and the child: the ``Stop`` call, then SIGTERM, then SIGKILL
        (``grace`` seconds for each); a child already gone is fine."""
        proc = self._proc
        try:
            if proc is not None and proc.returncode is None and self._writer is not None:
                with contextlib.suppress(ReplicaHostError, OSError, asyncio.TimeoutError):
                    await self._call(Stop(), timeout=grace)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if proc is not None:
                await _end(proc, grace)
            self._proc = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    # -- the socket ----------------------------------------------------------------------
    async def _call(self, call: Call, timeout: float | None = None) -> Reply:
        if self._writer is None:
            raise ReplicaHostError("the replica host is not running (start() first)")
        async with self._lock:  # one call at a time: replies come in order
            return await self._exchange(encode(call), timeout or self.call_timeout, type(call).__name__)

    async def _exchange(self, body: bytes, timeout: float, what: str) -> Reply:
        assert self._reader is not None and self._writer is not None
        self._writer.write(frame(body))
        try:
            await self._writer.drain()
            reply = decode_reply(await self._until_child(read_frame(self._reader), timeout, what))
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise ReplicaHostError(f"the replica host (pid {self.pid}) closed the connection during {what}"
                                   f"{self._exit_note()}") from e
        if not reply.ok:
            if reply.error_type == "TimeoutError":
                raise TimeoutError(reply.error)
            raise ReplicaHostError(f"{what} failed in the replica host: {reply.error_type}: {reply.error}")
        return reply

    async def _until_child(self, aw: Any, timeout: float, what: str) -> Any:
        """``aw``'s result, unless the child exits first or ``timeout`` passes (ReplicaHostError)."""
        assert self._proc is not None
        task = asyncio.ensure_future(aw)
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            done, _ = await asyncio.wait({task, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if exited in done:
            raise ReplicaHostError(f"the replica host (pid {self.pid}) exited during {what}{self._exit_note()}")
        raise ReplicaHostError(f"the replica host (pid {self.pid}) did not answer {what} within {timeout:.0f}s "
                               f"(ReplicasProcess start_timeout / call_timeout)")

    def _exit_note(self) -> str:
        rc = None if self._proc is None else self._proc.returncode
        return "" if rc is None else f" (exit status {rc}; its log is on this process's stderr)"


def _child_env() -> dict[str, str]:
    """This process's environment, with this rollq's folder first on ``PYTHONPATH`` (a checkout
    run from its root, as the benchmarks are, need not be installed)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))


async def _end(proc: asyncio.subprocess.Process, grace: float) -> None:
    """Wait ``grace`` s for ``proc`` to exit, then SIGTERM it, then SIGKILL it (by pid)."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            log.warning("replica host pid %d: sent %s", proc.pid, sig.name)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), grace)


# ----------------------------------------------------------------------------------------
# The child
# ----------------------------------------------------------------------------------------
async def _dispatch(replicas: Replicas, call: Call) -> Reply:
    if isinstance(call, Attach):
        await replicas.attach(call.queue, call.weights_root, abort_resume=call.abort_resume)
    elif isinstance(call, Detach):
        await replicas.detach()
    elif isinstance(call, WaitVersion):
        await replicas.wait_version(call.version, call.timeout)
    elif isinstance(call, Snapshot):
        return Reply(ok=True, snapshot=await replicas.snapshot())
    elif isinstance(call, Stop):
        await replicas.stop()
    return Reply(ok=True)


def _failed(e: BaseException) -> Reply:
    return Reply(ok=False, error_type=type(e).__name__, error=str(e)[:2000])


async def serve(path: str) -> int:
    """The child's side: connect to ``path``, read the config, start the replicas, answer
    calls until ``Stop`` or the end of the connection; the exit status (0: stopped as asked)."""
    reader, writer = await asyncio.open_unix_connection(path)

    async def send(reply: Reply) -> None:
        try:
            data = frame(encode(reply))
        except ProtocolError as e:  # a reply over the frame limit: the caller hears that instead
            data = frame(encode(_failed(e)))
        writer.write(data)
        await writer.drain()

    try:
        config = decode_config(await read_frame(reader))
    except Exception as e:  # noqa: BLE001 - told to the trainer, then this process ends
        await send(_failed(e))
        return 2
    logging.getLogger().setLevel(config.log_level)
    if config.pin:
        from .cores import pin_process

        pin_process(config.pin)
    replicas = Replicas(config.url, config.queue, **config.replicas_kwargs())
    try:
        try:
            t0 = time.perf_counter()
            await replicas.start()
            log.info("replica host: %d replica(s) serving %s in %.1fs", config.count, config.queue, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the engines did not start: the trainer hears why
            log.exception("replica host: the replicas did not start")
            await send(_failed(e))
            return 1
        await send(Reply(ok=True, snapshot=await replicas.snapshot()))
        while True:
            try:
                body = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.info("replica host: the trainer closed the connection; stopping")
                return 0
            try:
                call = decode_call(body)
                reply = await _dispatch(replicas, call)
            except Exception as e:  # noqa: BLE001 - a failed call is the caller's error, not this host's end
                await send(_failed(e))
                continue
            await send(reply)
            if isinstance(call, Stop):
                return 0
    finally:
        await replicas.stop()
        writer.close()


def main(argv: list[str] | None = None) -> int:
    """The host process's entry (``python -m rollq.rl._host_main SOCKET``); its logs go to
    stderr at the level the config sets (INFO until it arrives)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m rollq.rl._host_main SOCKET (started by rollq.rl.ReplicasProcess)\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s replica-host %(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(serve(args[0]))
