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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

import msgspec

from ..errors import ProtocolError, RollqError
from .host_wire import (
    Attach, Call, Cancel, Detach, HostConfig, Reply, Snapshot, Stop, WaitVersion, decode_call, decode_config, decode_reply,
    encode, frame, read_frame, seq_of,
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
    other call (``wait_version`` also by its own timeout). Calls may come from several tasks at
    once, as to ``Replicas``; a call its caller cancels, or that passes its timeout, is cancelled
    in the child too, and no later call is answered with its reply."""

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
        #: The calls waiting for their replies, by ``seq`` (0: the start); read by one task.
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._seq = 0
        self._replies: asyncio.Task[None] | None = None

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
        self._replies = asyncio.create_task(self._read_replies(self._reader))
        reply = await self._exchange(0, encode(self.config), self.start_timeout, "start")
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
            if self._replies is not None:
                self._replies.cancel()
                with contextlib.suppress(BaseException):
                    await self._replies
                self._replies = None
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
        self._seq += 1
        call = msgspec.structs.replace(call, seq=self._seq)
        return await self._exchange(self._seq, encode(call), timeout or self.call_timeout, type(call).__name__)

    async def _exchange(self, seq: int, body: bytes, timeout: float, what: str) -> Reply:
        """Send ``body`` (the call numbered ``seq``) and wait for its reply. A caller that gives
        up (cancelled, or ``timeout`` passed) withdraws the call: the host cancels it, and its
        reply, if one still comes, answers nothing."""
        assert self._writer is not None
        fut = self._pending[seq] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(frame(body))
            await self._writer.drain()
            reply = await self._until_child(fut, timeout, what)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            raise ReplicaHostError(f"the replica host (pid {self.pid}) closed the connection during {what}"
                                   f"{self._exit_note()}") from e
        finally:
            if self._pending.pop(seq, None) is not None and seq:  # no reply came: the caller gave up
                self._withdraw(seq)
        if not reply.ok:
            if reply.error_type == "TimeoutError":
                raise TimeoutError(reply.error)
            raise ReplicaHostError(f"{what} failed in the replica host: {reply.error_type}: {reply.error}")
        return reply

    def _withdraw(self, seq: int) -> None:
        """Tell the host to cancel call ``seq`` (nothing to do once the connection is gone)."""
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(encode(Cancel(target=seq))))

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        """Hand each reply to the call of its ``seq``; at the end of the connection (or a reply
        that does not decode) every waiting call fails with the reason."""
        try:
            while True:
                reply = decode_reply(await read_frame(reader))
                fut = self._pending.pop(reply.seq, None)
                if fut is None or fut.done():
                    log.debug("replica host: the reply to call %d came after its caller gave up", reply.seq)
                else:
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as e:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(e)

    async def _until_child(self, aw: Any, timeout: float, what: str) -> Any:
        """``aw``'s result, unless the child exits first or ``timeout`` passes (ReplicaHostError);
        ``aw`` is cancelled when this ends without it (the caller's cancellation included)."""
        assert self._proc is not None
        task = asyncio.ensure_future(aw)
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            done, _ = await asyncio.wait({task, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
        finally:
            exited.cancel()
            if not task.done():
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


def _failed(e: BaseException, seq: int = 0) -> Reply:
    return Reply(ok=False, seq=seq, error_type=type(e).__name__, error=str(e)[:2000])


async def serve(path: str) -> int:
    """The child's side: connect to ``path``, read the config, start the replicas, answer
    calls until ``Stop`` or the end of the connection; the exit status (0: stopped as asked)."""
    reader, writer = await asyncio.open_unix_connection(path)

    async def send(reply: Reply) -> None:
        try:
            data = frame(encode(reply))
        except ProtocolError as e:  # a reply over the frame limit: the caller hears that instead
            data = frame(encode(_failed(e, reply.seq)))
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
        return await _answer(reader, replicas, send)
    finally:
        await replicas.stop()
        writer.close()


async def _answer(reader: asyncio.StreamReader, replicas: Replicas, send: Callable[[Reply], Awaitable[None]]) -> int:
    """Answer calls until ``Stop`` (0) or the end of the connection (0). Each call runs as a
    task of its own and is answered when it ends, so that a long ``wait_version`` holds up no
    other call and a :class:`~rollq.rl.host_wire.Cancel` can end it; ``Stop`` runs in turn, and
    what still runs after it is cancelled."""
    running: dict[int, asyncio.Task[None]] = {}

    async def run(seq: int, call: Call) -> None:
        try:
            reply = await _dispatch(replicas, call)
        except asyncio.CancelledError:
            return  # withdrawn by its caller, or the host is ending: nobody waits for a reply
        except Exception as e:  # noqa: BLE001 - a failed call is the caller's error, not this host's end
            reply = _failed(e)
        finally:
            running.pop(seq, None)
        reply.seq = seq
        await send(reply)

    try:
        while True:
            try:
                body = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.info("replica host: the trainer closed the connection; stopping")
                return 0
            try:
                call = decode_call(body)
            except Exception as e:  # noqa: BLE001 - told to the caller
                await send(_failed(e, seq_of(body)))
                continue
            if isinstance(call, Cancel):
                task = running.get(call.target)
                if task is not None:
                    task.cancel()
            elif isinstance(call, Stop):
                for task in list(running.values()):
                    task.cancel()
                await run(call.seq, call)
                return 0
            else:
                running[call.seq] = asyncio.create_task(run(call.seq, call))
    finally:
        for task in list(running.values()):
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """The host process's entry (``python -m rollq.rl._host_main SOCKET``); its logs go to
    stderr at the level the config sets (INFO until it arrives)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m rollq.rl._host_main SOCKET (started by rollq.rl.ReplicasProcess)\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s replica-host %(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(serve(args[0]))
