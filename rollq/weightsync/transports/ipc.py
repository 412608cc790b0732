"""IPC transport: the trainer process shares a version's tensors with the replicas on its host,
whose workers copy them (device to device on a GPU) while the engine serves.

Trainer side :class:`IpcSend`: exposes the tensors (:class:`~rollq.weightsync.trainer.ipc_export.Exposure`:
CUDA IPC handles, or CPU shared memory), writes their handles
(:class:`~rollq.weightsync.ipc_wire.IpcHandles`) to ``QueueKeys.weights_ipc`` and returns the
record (transport ``ipc``); the publisher commits and announces it as any other. With a
memmap store (``WeightPublisher(root=...)``) it also writes a memmap copy, which replicas on
other hosts or GPUs, late joiners and replicas that could not copy load instead.

How long a version stays exposed: from its publish until the same publisher publishes the
next version over IPC, :func:`~.ipc_lease.release` is called, the publisher closes, or the trainer process
exits, whichever comes first. A replica still copying it then refuses it (it takes the next
one). Extra memory held meanwhile: none for CUDA tensors and CPU tensors already in shared
memory (zero-copy), one copy of every other CPU tensor (``timings["ipc_copied_bytes"]``). With
``WeightPublisher(ipc_snapshot=True)`` every tensor is copied at publish (CUDA tensors on their
GPU), so the trainer may update its weights in place right after publishing. With
``WeightPublisher(ipc_lease=True)`` the trainer's own tensors are exposed zero-copy and
without a checksum, on its promise to change none of them until it calls
``WeightPublisher.release_weights`` (:func:`~.ipc_lease.release_when_copied`), which waits until every live
replica on this host whose follower registered in ``QueueKeys.weights_ipc_copied`` has finished
its copy (the follower records it there; watching workers' statuses and served versions count too),
then releases the version. A replica whose copy ends after the release refuses the version.

Replica side :class:`IpcReceive`: has every worker copy and verify the version in a thread
(:mod:`rollq.weightsync.worker._ipc`), then swaps it in as a memmap-staged version is.
Handles that cannot be used (the trainer exited or released the version, before or during
the copy; another host or GPU) raise :class:`~rollq.weightsync.ipc_wire.IpcUnavailable`, and
exposed tensors that changed before a worker copied them :class:`~rollq.errors.CorruptWeights`:
the version is not applied, the follower records the load failure and the old weights serve
on; with a memmap copy in the record the replica loads that instead. With
``WeightSyncSettings.ipc_direct`` a leased version is only opened, claimed
(``QueueKeys.weights_ipc_claims``), and copied by the swap straight into the live weights
(:meth:`IpcReceive.swap`; on a GPU the copies run on the device after the swap call returns,
ahead of the next engine step, and the claim ends once they ended);
:func:`~.ipc_lease.release_when_copied` waits for the claims. With
``WeightSyncSettings.ipc_prestage`` the workers start each copy themselves when the version is
announced (:meth:`IpcReceive.watch`, :mod:`rollq.weightsync.worker._ipc_watch`) and the follower
reads how it stands from Redis; a copy they did not start, or that failed, it starts itself.
Watching workers also write when a direct swap's copies ended (``QueueKeys.weights_ipc_swaps``),
which the follower reads there too, without waiting for the engine's next answer.

>>> pub = WeightPublisher(url, queue="grpo")                                   # doctest: +SKIP
>>> rec = await pub.publish_weights(model.state_dict(), transport="ipc")      # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ...connection import RETRYABLE, Script
from ...errors import CorruptWeights, WeightSyncError, WeightSyncTimeout
from ..ipc_wire import IpcHandles, IpcUnavailable, TornDirectSwap, decode_handles, encode_handles, token_alive
from ..wire import IpcWatch, StageStatus, State, SwapReport, SwapTimes, WorkerError
from .base import ReplicaTransport, Staged, TrainerTransport
from .ipc_lease import EXPOSED, SHARES, watcher_status

if TYPE_CHECKING:
    import torch

    from ...keys import QueueKeys
    from ..versions import VersionRecord

log = logging.getLogger(__name__)

#: How long the follower waits for the workers' watchers to have started a version before it
#: starts the copy itself (the announcement reaches both at about the same time; a watcher
#: shares the GIL with the engine's busy loop, which may hold it 5 ms before the watcher
#: runs). A watcher that will not copy the version says so at once (``BUSY``).
WATCHER_GRACE_S = 0.025

#: While the workers' watchers copy, the follower reads their statuses first after
#: ``WATCH_POLL_FIRST_S``, then after twice as long each time, up to ``WATCH_POLL_S``: a
#: status written is seen that much later at most (each read is one HMGET on the replica's
#: Redis; ``benchmarks/ipc_watch_poll.py`` has the figures).
WATCH_POLL_FIRST_S = 0.0005
WATCH_POLL_S = 0.001

#: How long :meth:`IpcReceive.watch` waits for every watcher to listen.
WATCHERS_READY_S = 10.0

#: A replica's claim of a leased version before its direct swap
#: (``QueueKeys.weights_ipc_claims``); a publisher's release refuses it (:data:`IPC_RELEASE`).
IPC_CLAIM = Script("ipc_claim")


class IpcSend(TrainerTransport):
    """Exposes the version to the replicas on this host (see the module docstring)."""

    async def send(self, version: int, items: list[tuple[str, torch.Tensor]]) -> VersionRecord:
        from ..trainer.ipc_export import Exposure
        from ..versions import VersionRecord

        pub = self.publisher
        t0 = time.perf_counter()
        into = None
        if pub.ipc_snapshot and (last := EXPOSED.pop(pub, None)) is not None:
            # The last version is released before its snapshot is rewritten: a replica still
            # copying it then refuses it (its token is gone) rather than keep mixed bytes.
            last.release()
            into = last.snapshot or None
        x = await asyncio.to_thread(Exposure, version, items, pub.ipc_snapshot, into, pub.ipc_lease, SHARES.get(pub))
        try:
            await (await pub.redis()).set(pub.keys.weights_ipc, encode_handles(x.handles))
            rec = VersionRecord(
                version=version, transport="ipc", checksum=x.handles.checksum, num_tensors=len(items), nbytes=x.nbytes,
                trainer=pub.trainer_id, timings={
                    "expose_s": x.expose_s, "checksum_s": x.checksum_s, "ipc_copied_bytes": float(x.copied_bytes),
                    "ipc_snapshot_reused": float(x.reused), "ipc_shares_reused": float(x.shares_reused),
                    "ipc_s": time.perf_counter() - t0,
                },
            )
            if pub.store is not None:  # for replicas elsewhere, late joiners and failed copies
                info = await asyncio.to_thread(pub.store.write, version, items)
                rec.memmap_slot = info.slot
                rec.checksum = rec.checksum or info.checksum  # an owned snapshot took none
                rec.timings["write_s"] = info.write_s
        except BaseException:
            x.release()
            raise
        old = EXPOSED.get(pub)
        EXPOSED[pub] = x
        SHARES[pub] = x.shares
        if old is not None:
            old.release()
        return rec


class IpcReceive(ReplicaTransport):
    """Has every worker copy the version the trainer exposes, then swaps it in."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: Records of finished copies still being written (:meth:`_record_copied`).
        self._writes: set[asyncio.Task[None]] = set()
        #: Engine calls still running whose answers nobody waits for (:meth:`_copies_ended`).
        self._unheard: set[asyncio.Future[Any]] = set()
        #: The handles of the version claimed for a direct swap (:meth:`_claim`).
        self._claimed: IpcHandles | None = None

    async def stage(self, rec: VersionRecord, acks: list[Any] | None = None) -> Staged | None:
        """Every worker's copy of ``rec``; None (the follower loads the memmap copy) when the
        handles cannot be used, or the exposed tensors changed before a worker copied them,
        and the record has a memmap copy (written at publish); else IpcUnavailable or
        CorruptWeights. Either way this replica then no longer reads the trainer's tensors,
        which it records for a publisher releasing a leased version (:func:`release_when_copied`).

        A leased version the workers left to a direct swap (``WeightSyncSettings.ipc_direct``)
        is claimed here (``QueueKeys.weights_ipc_claims``): the trainer's tensors then stay as
        they are until :meth:`swap` has copied them; a version whose release began already
        is refused as unavailable."""
        direct = False
        try:
            staged = await self._stage(rec)
            if staged.report.get("direct"):
                await self._claim(rec.version)
                direct = True
            return staged
        except (IpcUnavailable, CorruptWeights) as e:
            if rec.memmap_slot is None or self.settings.root is None:
                raise
            log.warning("version %d: %s; loading its memmap copy instead", rec.version, e)
            return None
        finally:
            if not direct:  # a direct swap records its copy once it has made it
                self._record_copied(rec.version)

    async def unstage(self, staged: Staged) -> None:
        """A claimed direct swap that will not happen ends its claim (the release waits no more)."""
        h = self._claimed
        if h is not None and h.version == staged.version:
            self._claimed = None
            self._record_copied(staged.version, unclaim=True)

    async def _claim(self, version: int) -> None:
        """Claim leased ``version`` for a direct swap, for ``load_timeout`` at most (the swap
        ends it); IpcUnavailable once its publisher began releasing it, or exposes another."""
        assert self.client is not None and self.keys is not None  # _stage checked
        deadline_ms = int((time.time() + self.settings.load_timeout) * 1000)
        if not await IPC_CLAIM(self.client, [self.keys.weights_ipc_claims], [self.replica, version, deadline_ms]):
            raise IpcUnavailable(f"version {version}: its trainer began releasing it before this replica's direct swap")
        raw = await self.client.get(self.keys.weights_ipc)
        h = decode_handles(raw) if raw is not None else None
        if h is None or h.version != version:
            await self.client.hdel(self.keys.weights_ipc_claims, f"c:{self.replica}")
            raise IpcUnavailable(f"version {version}: its trainer exposes another version now")
        self._claimed = h

    async def register(self, serving: int) -> None:
        """Record that this replica follows IPC versions (``serving``: its version now), so a
        publisher releasing a leased version waits for its copy (:func:`release_when_copied`)."""
        if self.client is not None and self.keys is not None and self.replica:
            await self.client.hset(self.keys.weights_ipc_copied, self.replica, serving)

    def _record_copied(self, version: int, unclaim: bool = False) -> None:
        """Record that this replica finished copying ``version`` (in its :meth:`register`
        field), first ending its claim of a direct swap when ``unclaim``, without waiting for
        Redis (the swap goes on meanwhile)."""
        task = asyncio.create_task(self._write_copied(version, unclaim))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_copied(self, version: int, unclaim: bool) -> None:
        try:
            if unclaim and self.keys is not None:
                await self.client.hdel(self.keys.weights_ipc_claims, f"c:{self.replica}")
            await self.register(version)
        except RETRYABLE as e:  # the publisher's wait then ends at its timeout, or the claim's deadline
            log.warning("could not record the copy of version %d for the publisher: %s", version, e)

    async def _stage(self, rec: VersionRecord) -> Staged:
        if self.client is None or self.keys is None:
            raise WeightSyncError("the IPC transport needs the follower's Redis client and queue keys")
        timeout = self.settings.load_timeout
        if self._fields:
            staged = await self._watched(rec.version, self.keys)
            if staged is not None:
                return staged
        raw = await self.client.get(self.keys.weights_ipc)
        if raw is None:
            raise IpcUnavailable(f"version {rec.version}: the trainer exposes no version over IPC")
        started = await asyncio.wait_for(self._start(raw, rec.version), timeout)
        if not started:  # an engine without weights (echo): nothing to copy; the swap is empty too
            return Staged(rec.version, self)
        return await self._until_staged(rec, self.workers.ipc_status, delay=0.002, report={"ipc": True},
                                        failed=f"copying version {rec.version} over IPC failed",
                                        slow=f"copying version {rec.version} over IPC",
                                        refine=lambda errors, msg: _unavailable(rec.version, errors, msg))

    async def swap(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        """Swap the staged version in; a direct swap (claimed in :meth:`stage`) copies the
        trainer's tensors into the live weights here, then ends its claim once the copies
        ended on the device (:meth:`_copies_ended`; the engine steps on meanwhile, after them).
        A swap that timed out keeps the claim until its deadline: a worker may still be
        copying. A torn direct swap (:class:`~rollq.weightsync.ipc_wire.TornDirectSwap`) loads
        the record's memmap copy in its place when there is one (the same version, whole),
        else raises."""
        if not staged.report.get("direct"):
            return await self._swap_in_workers(rec, staged)
        h, self._claimed = self._claimed, None
        keep_claim = False
        try:
            if h is None or h.version != rec.version or not token_alive(h):
                # every worker refuses it alike: none copies what a dead trainer left
                raise IpcUnavailable(f"trainer process {h.pid if h else '?'} exited or released version {rec.version} "
                                     "before the direct swap")
            since = time.time()
            reports = await self._swap_each(rec, staged)
            if any(r.pending for r in reports):
                t0 = time.perf_counter()
                await self._copies_ended(rec.version, [r.pending for r in reports], since)
                reports[0].wait_copy_s = time.perf_counter() - t0
            return reports[0] if reports else SwapReport()
        except WeightSyncTimeout:
            keep_claim = True  # a worker may still be copying
            raise
        except TornDirectSwap as e:
            if rec.memmap_slot is None or self.settings.root is None:
                log.error("%s; no memmap copy of version %d to load instead: the replica's weights may be mixed until "
                          "a version loads", e, rec.version)
                raise
            log.warning("%s; loading its memmap copy instead", e)
            from .memmap import MemmapReceive

            return await MemmapReceive(self.engine, self.settings, self.receiver).load(rec)
        finally:
            if not keep_claim:
                self._record_copied(rec.version, unclaim=True)

    async def _copies_ended(self, version: int, pending: list[bool], since: float = 0.0, poll: float = 0.0005) -> None:
        """Wait until the direct swap's copies of ``version`` ended on every worker whose
        report said ``pending``, within ``load_timeout``. The engine is asked
        (``rollq_swap_done``; each answer comes between two engine steps, which run after the
        copies); with the workers watching (:meth:`watch`), each one's own write of the end
        (``QueueKeys.weights_ipc_swaps``, for a swap enqueued after ``since``, wall clock) is
        read every ``poll`` seconds meanwhile, which no engine step holds up. Raises
        TornDirectSwap when a worker's copies read tensors the trainer stopped guaranteeing
        meanwhile, WeightSyncTimeout when they do not end in time."""
        deadline = time.monotonic() + self.settings.load_timeout
        fields = ([f for f, p in zip(self._fields, pending) if p]
                  if self.read_swap_ends and len(self._fields) == len(pending) else [])
        ask: asyncio.Future[list[SwapTimes]] | None = None
        try:
            while True:
                if ask is None:
                    ask = asyncio.ensure_future(self.workers.swap_done())
                if fields:
                    try:
                        raw = await self.client.hmget(self.keys.weights_ipc_swaps, fields)  # type: ignore[union-attr]
                    except RETRYABLE as e:  # the engine's answers stand in
                        log.warning("could not read the direct swap's copies of version %d from Redis: %s", version, e)
                        fields = []
                    else:
                        if _copies_done(version, [_swap_times(r, since) for r in raw]):
                            return
                else:
                    await asyncio.wait([ask], timeout=max(0.0, deadline - time.monotonic()))
                if ask.done():
                    answer, ask = ask.result(), None
                    if _copies_done(version, [t for t, p in zip(answer, pending) if p]):
                        return
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(f"the direct swap's copies of version {version} did not end within "
                                            f"{self.settings.load_timeout}s")
                await asyncio.sleep(poll)
        finally:
            if ask is not None and not ask.done():  # answered between two steps; nobody waits for it
                self._unheard.add(ask)
                ask.add_done_callback(_dropped_answer)
                ask.add_done_callback(self._unheard.discard)

    #: Whether :meth:`_copies_ended` reads the watching workers' writes (benchmarks turn it
    #: off to compare with the engine's answers alone).
    read_swap_ends = True

    #: The watching workers' fields in ``QueueKeys.weights_ipc_staged`` (:meth:`watch`).
    _fields: tuple[str, ...] = ()

    @property
    def watching(self) -> bool:
        """Whether the workers start each copy themselves (:meth:`watch`)."""
        return bool(self._fields)

    async def watch(self, url: str, serving: int, replica: str) -> None:
        """Have the workers of replica ``replica`` start copying each version newer than
        ``serving`` when it is announced and write how their copy stands to Redis
        (``WeightSyncSettings.ipc_prestage``; :mod:`rollq.weightsync.worker._ipc_watch`), the
        replica's Redis at ``url``."""
        if self.client is None or self.keys is None:
            raise WeightSyncError("the IPC transport needs the follower's Redis client and queue keys")
        await self.close()
        field = f"{replica}/"
        fields = tuple(f"{field}{rank}" for rank in range(getattr(self.engine, "num_workers", 1)))
        for key in (self.keys.weights_ipc_staged, self.keys.weights_ipc_swaps):  # an earlier run's, under this id
            await self.client.hdel(key, *fields)
        n = await self.workers.watch_ipc(watch=IpcWatch(
            url=url, channel=self.keys.control, handles_key=self.keys.weights_ipc, status_key=self.keys.weights_ipc_staged,
            swaps_key=self.keys.weights_ipc_swaps, field=field, chunk_bytes=self.settings.ipc_chunk_bytes,
            keep_maps=self.settings.ipc_keep_mappings, serving=serving, high_priority=self.settings.ipc_high_priority,
            direct=self.settings.ipc_direct))
        self._fields = tuple(f"{field}{rank}" for rank in range(n))
        await self._listening(self.keys)

    async def _listening(self, keys: QueueKeys) -> None:
        """Until every watcher wrote its first status (it listens for announcements), for
        :data:`WATCHERS_READY_S` at most; a version announced before then may be copied by
        the follower instead (logged)."""
        deadline, delay = time.monotonic() + WATCHERS_READY_S, 0.001
        while self._fields and None in await self.client.hmget(keys.weights_ipc_staged, list(self._fields)):
            if time.monotonic() > deadline:
                log.warning("the workers' IPC watchers did not report within %.0fs; the follower starts copies "
                            "they have not started", WATCHERS_READY_S)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def close(self) -> None:
        if self._writes:  # let the records of finished copies reach Redis
            await asyncio.wait(list(self._writes), timeout=1.0)
        fields, self._fields = self._fields, ()
        if not fields:
            return
        try:
            await self.workers.unwatch_ipc()
        except Exception as e:  # the engine is gone: its watchers went with it
            log.debug("could not stop the workers' IPC watchers: %s", e)
        if self.keys is not None:
            with contextlib.suppress(*RETRYABLE):
                for key in (self.keys.weights_ipc_staged, self.keys.weights_ipc_swaps):
                    await self.client.hdel(key, *fields)

    async def _watched(self, version: int, keys: QueueKeys) -> Staged | None:
        """``version`` as the workers' watchers copied it, read from Redis (waiting while they
        copy); None when they did not start it (the follower then starts it itself) or their
        copy failed (it tries again, and records the failure)."""
        deadline = time.monotonic() + self.settings.load_timeout
        grace = time.monotonic() + WATCHER_GRACE_S  # the announcement reaches the watchers about when it reaches us
        delay = WATCH_POLL_FIRST_S
        while True:
            got = await self.client.hmget(keys.weights_ipc_staged, list(self._fields))
            mine = [st for st in map(watcher_status, got) if st is not None and st.version == version]
            if len(mine) < len(got):  # not (yet) started by every watcher
                if time.monotonic() > grace or any(st.state is State.BUSY for st in mine):
                    return None
            elif any(st.state in (State.FAILED, State.BUSY) for st in mine):  # BUSY: a watcher will not copy it
                return None
            elif all(st.state is State.STAGED for st in mine):
                return Staged(version, self, report=dict(mine[0].report(), ipc=True, prestaged=True))
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"copying version {version} over IPC took longer than {self.settings.load_timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, WATCH_POLL_S)

    async def _start(self, raw: bytes, version: int) -> list[StageStatus]:
        """Have every worker start copying ``version``; a worker whose watcher still copies an
        older one is asked again once that copy has ended."""
        while True:
            started = await self.workers.stage_ipc(handles=raw, version=version, chunk_bytes=self.settings.ipc_chunk_bytes,
                                                   keep_maps=self.settings.ipc_keep_mappings,
                                                   high_priority=self.settings.ipc_high_priority,
                                                   direct=self.settings.ipc_direct)
            if not any(s.state is State.BUSY and s.version != version for s in started):
                return started
            delay = 0.002
            while any(s.state is State.STAGING and s.version != version for s in await self.workers.ipc_status()):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.01)


def _copies_done(version: int, times: list[SwapTimes | None]) -> bool:
    """Whether every worker's ``times`` say the copies of ``version`` ended; TornDirectSwap
    when one says they were torn."""
    torn = [t.torn for t in times if t is not None and t.version == version and t.torn]
    if torn:
        raise TornDirectSwap(torn[0])
    return all(t is not None and t.version == version and t.done_at is not None for t in times)


def _swap_times(raw: bytes | None, since: float) -> SwapTimes | None:
    """A worker's SwapTimes as written to Redis, when of a swap enqueued after ``since``."""
    if raw is None:
        return None
    try:
        t = msgspec.msgpack.decode(raw, type=SwapTimes)
    except msgspec.DecodeError as e:
        log.debug("unreadable swap times in Redis: %s", e)
        return None
    return t if t.enqueued_at >= since else None


def _dropped_answer(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("an engine answer nobody waited for failed: %s", fut.exception())


def _unavailable(version: int, errors: list[WorkerError], msg: str) -> Exception | None:
    """A worker could not open the handles (the trainer died or released the version)."""
    if any(e.kind == IpcUnavailable.__name__ for e in errors):
        return IpcUnavailable(f"version {version} not copied: {msg}")
    return None
