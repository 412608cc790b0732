"""Worker side of the IPC transport's prestaging: starting each copy when its version is
announced.

Runs in a daemon thread of each vLLM worker process, with its own blocking Redis connection
(as the broadcast's :class:`~rollq.weightsync.worker._listener.OfferListener` does): the copy
starts when the trainer's ``version <v>`` announcement arrives, while the replica's follower
is still waking up, reading the record and checking it, and no engine RPC (which waits for
the engine's current step) stands in front of it. The follower then finds the version
staging or staged (:meth:`~rollq.weightsync.worker._ipc.IpcStaging.prestage`), as each watcher
writes it to ``IpcWatch.status_key`` when the copy starts and when it ends (so the follower
reads it from Redis, with the record, instead of asking the engine), and only waits for it and
swaps it in; it never swaps in a version whose record it has not read and checked. Pub/sub is only a hint: the exposed handles are checked every ``watch.poll`` seconds
too. Each exposed version is tried once; a copy that fails here is started again by the
follower (which records the failure).

Each watcher writes its status once it listens (subscribed, the exposed handles checked once),
so :meth:`~rollq.weightsync.transports.ipc.IpcReceive.watch` returns only then; and a version
it will not copy (a copy still runs, or a staged version waits for its swap) as ``BUSY`` with
that version, so the follower starts that copy itself at once instead of waiting for the
watcher. From the announcement's arrival on, the watcher holds a short GIL switch interval
(:func:`~rollq.weightsync.process_group.responsive_gil`): it shares the GIL with the engine's
busy loop, and each of its few blocking steps (reading the handles, starting the copy,
writing its status) would otherwise wait up to the interpreter's 5 ms for it.

A direct swap's copies end on the device after the swap call returned; the worker's thread
that waits for them writes their end (:class:`~rollq.weightsync.wire.SwapTimes`) through
:meth:`IpcWatcher.report_swap` to ``IpcWatch.swaps_key``, over a second connection of the
watcher's, so the follower reads it there instead of asking the engine, whose answer waits for
the step that follows the copies.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec

from ...protocol import Control, parse_control
from ..ipc_wire import MalformedIpcHandles, decode_handles
from ..process_group import responsive_gil
from ..wire import IpcWatch, StageStatus, State, SwapTimes
from ._listener import follow_channel, sync_client

if TYPE_CHECKING:
    from ._ipc import IpcStaging

log = logging.getLogger(__name__)


class IpcWatcher:
    """Starts ``staging``'s copy of each newly exposed version (see the module docstring)."""

    def __init__(self, staging: IpcStaging, watch: IpcWatch, rank: int = 0):
        self.staging = staging
        self.watch = watch
        self.rank = rank
        self.tried = watch.serving  # the newest exposed version this watcher looked at
        self.listening = False  # its status written once after it subscribed
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollq-ipc-watch", daemon=True)
        #: The connection :meth:`report_swap` writes over (the swap threads', not this one's).
        self._swaps: Any = None
        self._swaps_lock = threading.Lock()

    def start(self) -> IpcWatcher:
        self._thread.start()
        return self

    def close(self) -> None:
        self.closed.set()
        with self._swaps_lock:
            client, self._swaps = self._swaps, None
        if client is not None:
            client.close()

    def report_swap(self, times: SwapTimes) -> None:
        """Write a direct swap's ``times`` (its copies ended, or were torn) to the watch's
        ``swaps_key`` for the follower (called by the worker's thread that waited for them).
        A write that fails is logged: the follower asks the engine (``rollq_swap_done``) too."""
        if not self.watch.swaps_key or self.closed.is_set():
            return
        try:
            with responsive_gil(), self._swaps_lock:
                self._swap_client().hset(self.watch.swaps_key, f"{self.watch.field}{self.rank}", msgspec.msgpack.encode(times))
        except Exception as e:  # Redis down or restarting: the engine's answer stands in
            log.warning("IPC watcher of rank %d could not write the end of version %d's copies: %s: %s",
                        self.rank, times.version, type(e).__name__, e)

    def _run(self) -> None:
        follow_channel(self.watch.url, self.watch.channel, self.closed, self.check, self._wait_hint,
                       f"IPC watcher of rank {self.rank}")

    def _wait_hint(self, pubsub: Any) -> None:
        """Until a version announcement or ``poll`` seconds (other control traffic drained)."""
        msg = pubsub.get_message(timeout=self.watch.poll)
        while msg is not None:
            if parse_control(str(msg.get("data", b""), "latin-1"))[0] is Control.VERSION:
                return
            msg = pubsub.get_message(timeout=0)

    def check(self, client: Any) -> bool:
        """Start copying the exposed version if it is new here; returns whether it started.
        The first check writes that this watcher listens: ``IDLE`` at the version the replica
        served when it began watching (not the worker's last staging, which may be of
        another queue's versions), unless it started a copy."""
        with responsive_gil():
            started = self._check(client)
            if not self.listening:
                self.listening = True
                if not started:
                    self._report(client, StageStatus(state=State.IDLE, version=self.watch.serving))
                self._connect_swaps()
            return started

    def _connect_swaps(self) -> None:
        """Open :meth:`report_swap`'s connection ahead of the first swap."""
        if not self.watch.swaps_key:
            return
        try:
            with self._swaps_lock:
                self._swap_client().ping()
        except Exception as e:  # report_swap connects again, or logs why it cannot
            log.debug("IPC watcher of rank %d: %s", self.rank, e)

    def _swap_client(self) -> Any:
        """:meth:`report_swap`'s connection, made on first use (``_swaps_lock`` held)."""
        if self._swaps is None:
            self._swaps = sync_client(self.watch.url)
        return self._swaps

    def _check(self, client: Any) -> bool:
        raw = client.get(self.watch.handles_key)
        if raw is None:
            return False
        try:
            version = decode_handles(raw).version
        except MalformedIpcHandles as e:  # the follower refuses it with the reason
            log.debug("IPC watcher of rank %d: %s", self.rank, e)
            return False
        if version <= self.tried:
            return False
        self.tried = version
        if not self.staging.prestage(raw, version, self.watch.chunk_bytes, self.watch.keep_maps,
                                      self.watch.high_priority, self.watch.direct):
            self._report(client, StageStatus(state=State.BUSY, version=version))  # the follower copies it
            return False
        self._report(client)  # staging
        self.staging.wait()
        self._report(client)  # staged or failed
        return True

    def _report(self, client: Any, status: StageStatus | None = None) -> None:
        """This worker's copy (or ``status``), for the follower to read without an engine RPC."""
        client.hset(self.watch.status_key, f"{self.watch.field}{self.rank}",
                    msgspec.msgpack.encode(self.staging.status if status is None else status))
