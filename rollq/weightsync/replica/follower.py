"""Replica side of weight sync: follow the durable version record and apply new versions.

Runs in the consumer's process, on its event loop, and drives the consumer only through its
weight-sync seam (:class:`~rollq.weightsync.base.ReplicaSide`) and its workers only through
the worker-call stub
:class:`~rollq.weightsync.replica.worker_calls.WorkerCalls` (:mod:`rollq.weightsync.worker.ext`). The record's transport name picks
the replica side that stages a version (:mod:`rollq.weightsync.transports`); a record that
also offers a memmap copy is loaded from it when that transport brought nothing here.

>>> follower = WeightFollower(consumer, WeightSyncSettings(root="/dev/shm/rollq-weights"))  # doctest: +SKIP
>>> await follower.start()      # loads the current version before the consumer pulls  # doctest: +SKIP

Pub/sub ``version N`` messages only make it look sooner: the follower reconciles with the
durable record on start, after every hint, and every ``reconcile_interval`` seconds, so a
missed message costs at most that long. Older or equal versions are ignored.

Applying a version follows the queue's update policy (``config`` hash, ``update_policy``):

- ``keep``: close rollq's intake, swap the new weights in while in-flight requests stay,
  salt the prefix cache, reopen; those requests finish on the new weights and their results
  carry the span ``(version_start, version_end)``. The version is read, copied to the device
  (and verified) while the engine keeps serving; the swap is one ``collective_rpc``, which
  vLLM's engine core runs between two scheduler steps, so no step mixes versions and
  generation stops only for the swap itself. vLLM's ``pause_generation(keep)`` is not
  needed for that and costs tens of milliseconds under load, so it is not used.
- ``abort``: close intake, abort in-flight requests, load, then run them again from scratch
  on the new weights (they stay leased to this replica: nothing is lost or duplicated), or
  with ``WeightSyncSettings.abort_resume`` continue from their tokens (``_abort``).
- ``drain``: close intake, let in-flight requests finish on the old weights, load, reopen.

The pause (generation stopped) and the whole update time are recorded per replica.

On start the follower publishes the checkpoint manifest of the served model (names, dtypes,
shapes from the model folder's safetensors headers; :mod:`rollq.weightsync.manifest`), which
publishers check state dicts against, and checks each memmap version's manifest against it
before loading. A version that cannot be loaded is recorded and retried a few times at most
(:mod:`rollq.weightsync.replica._load_failures`). Broadcast versions arrive while the replica serves
(:mod:`rollq.weightsync.replica._receiver`); with ``swap_overlap`` they may go live while the last of
them still arrives (:mod:`rollq.weightsync.replica._overlap`).

A replica that starts while the trainer broadcasts versions joins the next group before it
loads anything. The committed version may then be one it cannot load: broadcast before it
joined, with no memmap copy. It does not serve the checkpoint's weights meanwhile: ``start``
waits (at most ``load_timeout``) for the next version, which it receives as a member of the
trainer's next group, and only then returns, so the consumer pulls nothing before (a version
with a memmap copy is loaded from it at once). A running replica that misses a broadcast
version (left out of its group) keeps serving the version it holds and takes the next one.

An engine that dies during an update ends the update at once (the engine adapter raises
:class:`~rollq.errors.EngineDead` from the call that waited on it): that is no load failure
of the version, so nothing is recorded against it, and the follower stops; the consumer
notices the death itself and hands its jobs back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from ..._tasks import stop_task
from ...connection import RETRYABLE
from ...errors import EngineDead, WeightSyncError, WeightSyncTimeout
from ...protocol import Control
from ...settings import WeightSyncSettings
from ..base import Receiver, ReplicaSide
from ._abort import end_running
from ._checks import check_dtypes, check_slot
from ._load_failures import LoadFailures
from ..manifest import Manifest, encode_manifest, read_manifest
from ._overlap import OverlappedSwap
from ._stats import HISTORY_KEEP, UpdateStats, kept_load
from ..transports import ReplicaTransport, Staged, replica_transport
from ..transports.broadcast import MissedBroadcast
from ..transports.ipc import IpcReceive
from ..transports.memmap import MemmapReceive
from ..versions import VersionRecord, decode_record
from ..wire import SwapReport, to_wire

log = logging.getLogger(__name__)

POLICIES = ("keep", "abort", "drain")


class WeightFollower:
    """Keeps one replica's engine at the newest committed policy version.

    ``settings``: :class:`~rollq.settings.WeightSyncSettings` (a memmap ``root``, ``broadcast``,
    timeouts, retries, ``swap_overlap``: see :class:`~rollq.weightsync.replica._overlap.OverlappedSwap`,
    :attr:`overlap`).
    """

    def __init__(self, consumer: ReplicaSide, settings: WeightSyncSettings | None = None):
        s = self.settings = settings or WeightSyncSettings()
        self.consumer = consumer
        self.engine = consumer.engine
        #: Checkpoint manifest of the served model (None: the engine has no model folder).
        self.manifest: Manifest | None = None
        #: The newest :data:`~._stats.HISTORY_KEEP` updates applied, oldest first.
        self.history: collections.deque[UpdateStats] = collections.deque(maxlen=HISTORY_KEEP)
        self.failures = 0
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: Any = None
        self._hinted = 0  # newest version announced on pub/sub (its acks are read with the record)
        self._hinted_at = 0.0  # when that announcement arrived (wall clock)
        self._load_call_s = 0.0
        self._policy: str | None = None  # the queue's update policy as last read
        self._missed = 0  # a broadcast version this replica did not receive (it waits for the next)
        #: The last committed version this replica failed to load, and its retries.
        self.load_failures = LoadFailures(consumer, s.load_retries, s.load_retry_delay)
        #: Broadcast receiver (rollq.weightsync.replica._receiver) whose workers stage versions while serving.
        self.receiver: Receiver | None = None
        if s.broadcast:
            from ._receiver import ReplicaReceiver

            self.receiver = ReplicaReceiver(consumer)
        #: Replica sides of the transports, by record name (rollq.weightsync.transports.factory).
        self._transports: dict[str, ReplicaTransport] = {}
        #: Every transport's fallback: a record's memmap copy.
        self.memmap = MemmapReceive(self.engine, s, self.receiver)
        #: Swaps of broadcast versions while they arrive (``keep`` policy, one worker).
        self.overlap = OverlappedSwap(
            consumer, self._lock, set_version=self._set_version, applied=self._overlapped, enabled=s.swap_overlap,
            lead_s=s.overlap_lead_s, commit_timeout=s.overlap_commit_timeout, programs=s.overlap_programs, load_timeout=s.load_timeout,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Catch up with the committed version (before the consumer pulls), then follow it.

        Raises :class:`~rollq.errors.WeightSyncError` for ``swap_overlap`` on a replica of
        several broadcast workers (tensor parallel): swapping parts in while the rest arrives
        would need every worker to agree on commit or undo of each part, which they do not.
        """
        from ...connection import connect

        if self.overlap.enabled and self.receiver is not None and self.receiver.num_workers > 1:
            raise WeightSyncError(
                f"swap_overlap needs a replica of one worker; replica {self.consumer.id} has "
                f"{self.receiver.num_workers} (tensor parallel), whose workers cannot agree on committing or "
                "undoing each part. Start it without swap_overlap (rollq consume without --swap-overlap): "
                "versions then swap in after the commit"
            )
        self._client = connect(self.consumer.redis_settings)
        await self._publish_manifest()
        self.consumer.add_control_handler(self._on_control)
        self.consumer.close_intake()  # a restarted replica loads the current version first
        try:
            if self.receiver is not None:  # a member of the trainer's next group from now on
                await self.receiver.start(self._client)
            await self._catch_up()
            if self.load_failures.current is None:  # an entry left by an earlier run under this id
                await self.load_failures.clear(self._client)
        except BaseException:
            if self.receiver is not None:
                await self.receiver.stop()
            raise
        finally:
            self.consumer.open_intake()
        ipc = self.transport("ipc")
        if isinstance(ipc, IpcReceive):  # a publisher releasing a leased version waits for this replica
            await ipc.register(self.consumer.version)
            if self.settings.ipc_prestage and hasattr(self.engine, "call_workers"):
                await ipc.watch(self.consumer.redis_settings.full_url, self.consumer.version, self.consumer.id)
        self._task = asyncio.create_task(self._loop(), name="rollq-weight-follower")

    async def _catch_up(self) -> None:
        """Load the committed version; one broadcast before this replica joined is not
        loadable: wait (``load_timeout``) for the next version instead (module docstring)."""
        deadline = time.monotonic() + self.settings.load_timeout
        while True:
            try:
                await self._reconcile_with_retry()
                return
            except MissedBroadcast as e:
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(
                        f"{e}; no newer version arrived within {self.settings.load_timeout}s (WeightFollower load_timeout)"
                    ) from e
                if self._missed != e.version:
                    self._missed = e.version
                    log.info("replica %s: %s; it serves nothing until the next version arrives", self.consumer.id, e)
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        await self.overlap.stop()
        if self.receiver is not None:
            await self.receiver.stop()
        if self._task is not None:
            await stop_task(self._task)
        for t in self._transports.values():
            await t.close()
        if self._client is not None:
            try:  # a stopped replica serves nothing: its manifest, load error and IPC record go with it
                pipe = self._client.pipeline(transaction=False)
                pipe.hdel(self.consumer.keys.manifests, self.consumer.id)
                pipe.hdel(self.consumer.keys.load_errors, self.consumer.id)
                pipe.hdel(self.consumer.keys.weights_ipc_copied, self.consumer.id)
                pipe.hdel(self.consumer.keys.weights_ipc_claims, f"c:{self.consumer.id}")
                await pipe.execute()
            except RETRYABLE as e:
                log.debug("could not remove this replica's manifest (%s)", e)
            await self._client.aclose()

    async def _publish_manifest(self) -> None:
        """Read the served checkpoint's manifest (headers only) and publish it for publishers."""
        model = getattr(self.engine, "model", "") or ""
        asked = getattr(getattr(self.engine, "config", None), "dtype", None)
        named = isinstance(asked, str) and asked not in ("", "auto")
        try:
            self.manifest = await asyncio.to_thread(read_manifest, model, getattr(self.engine, "dtype", "") or None, named)
        except (OSError, ValueError, KeyError) as e:
            log.warning("cannot read the checkpoint manifest of %s (%s); publishers will not check weights against it", model[:200], e)
            self.manifest = None
        if self.manifest is None:
            log.debug("engine model %r has no safetensors checkpoint folder: no manifest published", model[:200])
            return
        try:
            await self._client.hset(self.consumer.keys.manifests, self.consumer.id, encode_manifest(self.manifest))
        except RETRYABLE as e:
            log.warning("could not publish the checkpoint manifest (%s); publishers will not check weights against it", e)
            return
        log.info("replica %s published the manifest of %s (%d tensors)", self.consumer.id, model[:200], len(self.manifest.tensors))

    def _on_control(self, verb: Control, arg: str) -> None:
        if verb is Control.WOFFER and self._can_overlap():
            try:
                v = int(arg.split()[0])
            except (ValueError, IndexError):
                return
            self.overlap.offered(v, self._can_overlap)
        elif verb is Control.VERSION:
            try:
                v = int(arg.split()[0])
                if v > self._hinted:
                    self._hinted, self._hinted_at = v, time.time()
            except (ValueError, IndexError):
                pass
            self._kick.set()

    async def _reconcile_with_retry(self) -> None:
        delay = 0.2
        while True:
            try:
                await self.reconcile()
                return
            except RETRYABLE as e:
                log.warning("cannot read the version record (%s); retrying", e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _loop(self) -> None:
        while True:
            wait = self.load_failures.wake_in(self.settings.reconcile_interval)  # wake for a retry
            try:
                await asyncio.wait_for(self._kick.wait(), wait)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                await self._reconcile(from_loop=True)
                f = self.load_failures.current
                if f is not None and self.consumer.version >= f.version:  # loaded meanwhile (overlapped swap)
                    await self.load_failures.clear(self._client)
            except asyncio.CancelledError:
                raise
            except EngineDead as e:
                log.error("replica %s: the engine died during a weight update (%s); the follower stops", self.consumer.id, e)
                return
            except Exception as e:
                self.failures += 1
                log.error("weight update failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(min(5.0, 0.2 * self.failures))

    # -- applying versions ---------------------------------------------------------------
    async def reconcile(self) -> UpdateStats | None:
        """Apply the committed version if it is newer than the loaded one.

        A load that fails is recorded (see the module docstring) and raised; an explicit call
        tries again even a version the follower gave up on.
        """
        return await self._reconcile(from_loop=False)

    async def _reconcile(self, from_loop: bool) -> UpdateStats | None:
        """The loop's reconcile skips a version that failed until its retry is due (or for
        good, once final) and does not raise load failures (they are recorded)."""
        woke_at = time.time()
        async with self._lock:
            t0 = time.perf_counter()
            # One round trip: the record, the policy and (for an announced broadcast version)
            # this replica's acks; every await here waits behind a busy consumer's event loop.
            keys = self.consumer.keys
            pipe = self._client.pipeline(transaction=False)
            pipe.hget(keys.version, "d")
            pipe.hget(keys.config, "update_policy")
            receiver = self.receiver
            hinted = self._hinted if receiver is not None and self._hinted > self.consumer.version else 0
            if receiver is not None and hinted:
                pipe.hmget(keys.weights_acks(hinted), receiver.fields())
            got = await pipe.execute()
            rec = decode_record(got[0]) if got[0] else None
            if rec is None or rec.version <= self.consumer.version:
                return None
            if from_loop and (self.load_failures.waiting(rec.version) or rec.version == self._missed):
                return None
            p = got[1].decode() if isinstance(got[1], bytes) else got[1]
            policy = self._policy = p if p in POLICIES else self.settings.default_policy
            acks = got[2] if hinted and hinted == rec.version else None
            self.overlap.note_acks(acks)
            read_s = time.perf_counter() - t0
            try:
                check_slot(rec, self.manifest, self.settings.root)
                check_dtypes(rec, self.consumer, getattr(self.engine, "dtype", "") or "", self.manifest)
                st = await self.apply(rec, policy, acks=acks)
            except (asyncio.CancelledError, EngineDead):
                raise  # a dead engine says nothing about the version
            except MissedBroadcast as e:  # not a load failure: the next version comes to us
                if from_loop:
                    if self._missed != rec.version:
                        log.info("replica %s: %s; it keeps serving version %d", self.consumer.id, e, self.consumer.version)
                    self._missed = rec.version
                    return None
                raise
            except Exception as e:
                await self.load_failures.record(self._client, rec.version, e)
                if from_loop:
                    return None
                raise
            st.timings.update(read_s=read_s, hinted_at=self._hinted_at if self._hinted == rec.version else 0.0,
                              woke_at=woke_at, recorded_at=time.time())
            self.history.append(st)
            self.failures = 0
            if self.load_failures.current is not None:
                await self.load_failures.clear(self._client)
            await self.consumer.announce()  # waiters (wait_for_replicas) see the version now
            return st

    # -- swap overlapped with the receive ---------------------------------------------------
    def _can_overlap(self) -> bool:
        return self.receiver is not None and self.overlap.possible(self.receiver.num_workers, self._policy)

    def _overlapped(self, version: int, report: SwapReport, update_s: float, pause_s: float) -> None:
        """An overlapped swap made ``version`` live (under the lock); it came over the
        receiver's group, whose backend names the transport."""
        transport = (self.receiver.backend if self.receiver is not None else None) or "broadcast"
        self.history.append(self._updated(UpdateStats(
            version, "keep", transport, update_s, pause_s, to_wire(report), timings={"load_call_s": pause_s, "read_s": 0.0, "hinted_at": 0.0},
        )))
        self.failures = 0

    async def apply(self, rec: VersionRecord, policy: str, acks: list[Any] | None = None) -> UpdateStats:
        """Swap ``rec`` in under ``policy`` (see the module docstring); ``acks``: this
        replica's acks of a broadcast version, already read."""
        c = self.consumer
        t0, staging_at = time.perf_counter(), time.time()
        staged = await self._staged(rec, acks)
        stage_call_s = time.perf_counter() - t0
        aborted: list[Any] = []
        paused = False
        swap_at = time.time()
        with c.paused_for_update():
            try:
                t_pause = time.perf_counter()  # generation stops for at most this long
                if policy not in ("keep", "drain"):
                    aborted, paused = await end_running(c, self.engine, self.settings)
                    if not paused:  # aborted one by one: generation stops from the engine's pause on
                        t_pause = time.perf_counter()
                report = await self._swap(rec, staged, policy, paused=paused)
                pause_s = time.perf_counter() - t_pause
            except BaseException:
                if staged is not None:  # a swap never reached lets go of what staging holds
                    await staged.transport.unstage(staged)
                raise
            finally:
                if aborted:  # before intake reopens
                    c.restart(aborted)
        load = dict(staged.report if staged is not None else {}, **to_wire(report))
        return self._updated(UpdateStats(rec.version, policy, rec.transport, time.perf_counter() - t0, pause_s, load,
                                         timings={"stage_call_s": stage_call_s, "load_call_s": self._load_call_s,
                                                  "staging_at": staging_at, "swap_at": swap_at}))

    def transport(self, name: str) -> ReplicaTransport:
        """The replica side of the transport called ``name`` in records
        (:class:`~rollq.weightsync.transports.factory.UnknownTransport` for a name not registered)."""
        t = self._transports.get(name)
        if t is None:
            t = self._transports[name] = replica_transport(name)(
                self.engine, self.settings, self.receiver, client=self._client, keys=self.consumer.keys, replica=self.consumer.id)
        return t

    async def _staged(self, rec: VersionRecord, acks: list[Any] | None) -> Staged | None:
        """What this replica's workers hold of ``rec`` already (received while serving), or
        have staged now (the record's memmap copy, when its own transport has nothing); None:
        the swap loads it."""
        transport = self.transport(rec.transport)
        staged = await transport.stage(rec, acks)
        if staged is None and not isinstance(transport, MemmapReceive):
            # Read, copy and verify while still serving; the pause only swaps it in.
            staged = await self.memmap.stage(rec)
        return staged

    async def _swap(self, rec: VersionRecord, staged: Staged | None, policy: str, paused: bool = False) -> SwapReport:
        """Load ``rec`` (intake is closed): after the running requests finished (``drain``),
        beside them (``keep``), or with the engine paused after aborting them (``abort``;
        ``paused``: the engine was paused for it already)."""
        abort = policy not in ("keep", "drain")
        if policy == "drain":
            await self._wait_drained()
        elif abort and not paused:
            await self.engine.pause("abort")
        try:
            # Outputs that arrive between the swap and _set_version are held back until the
            # swap's report says how far each request had got (the engine may finish a
            # request on the new weights before this coroutine resumes).
            with self.consumer.swapping():
                report = await self._load(rec, staged)
                # set_version also gives later requests a fresh prefix-cache salt, so none
                # reuses a prefix of the old weights while running requests hold the cache.
                self._set_version(rec.version, report)
            if policy != "keep":
                await self.engine.reset_prefix_cache()  # nothing runs: free the old blocks
        finally:
            if abort:
                await self.engine.resume()
        return report

    def _updated(self, st: UpdateStats) -> UpdateStats:
        """Account for an applied update on the consumer (status, paused total) and log it."""
        c = self.consumer
        c.record_update(st.update_s, st.pause_s)
        st.load = kept_load(st.load)  # the per-request progress was used by the swap; history keeps its size
        log.info(
            "replica %s now at policy version %d (%s, %s%s): update %.3fs, paused %.3fs",
            c.id, st.version, st.policy, st.transport, ", swapped in while arriving" if st.load.get("swap") == "overlap" else "",
            st.update_s, st.pause_s,
        )
        return st

    def _set_version(self, v: int, report: SwapReport) -> None:
        """The engine serves ``v`` now; ``report`` (the swap call's) carries how far each
        running request had got, for the per-token versions of their results."""
        self.consumer.set_version(v, self.engine.swap_progress(report.progress))

    async def _wait_drained(self) -> None:
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.consumer.running_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _load(self, rec: VersionRecord, staged: Staged | None) -> SwapReport:
        t0 = time.perf_counter()
        try:
            return await self._load_now(rec, staged)
        finally:
            self._load_call_s = time.perf_counter() - t0

    async def _load_now(self, rec: VersionRecord, staged: Staged | None) -> SwapReport:
        """The swap call: a staged version swapped in, else ``rec`` loaded from memmap now."""
        if staged is not None:
            return await staged.transport.swap(rec, staged)
        return await self.memmap.load(rec)
