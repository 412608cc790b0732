"""Replica side of weight sync: follow the durable version record and apply new versions.

>>> follower = WeightFollower(consumer, root="/dev/shm/rollq-weights")      # doctest: +SKIP
>>> await follower.start()      # loads the current version before the consumer pulls

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
  on the new weights (they stay leased to this replica: nothing is lost or duplicated).
- ``drain``: close intake, let in-flight requests finish on the old weights, load, reopen.

The pause (generation stopped) and the whole update time are recorded per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..connection import RETRYABLE
from ..errors import CorruptWeights, WeightSyncError, WeightSyncTimeout
from .versions import VersionRecord, decode_record

log = logging.getLogger(__name__)

POLICIES = ("keep", "abort", "drain")


@dataclass
class UpdateStats:
    version: int
    policy: str
    transport: str
    update_s: float  # from noticing the version to serving it
    #: Intake closed around the swap (keep/abort) or the drain (drain). On GPUs with shadow
    #: weights the swap call only enqueues the device copies (15.2 GB in ~8 ms on an H200),
    #: which finish before the engine's next step; generation stops for those copies plus the
    #: step in flight, not for this whole time.
    pause_s: float
    load: dict[str, Any] = field(default_factory=dict)
    #: Where the update's time went on this side: ``read_s`` (the record, policy and acks),
    #: ``load_call_s`` (the load or swap call to the engine, as the follower saw it) and
    #: ``hinted_at`` (wall clock when the pub/sub announcement reached this follower; 0: the
    #: update was found by polling).
    timings: dict[str, float] = field(default_factory=dict)


class WeightFollower:
    """Keeps one replica's engine at the newest committed policy version."""

    def __init__(
        self,
        consumer: Any,
        *,
        root: str | None = None,
        reconcile_interval: float = 5.0,
        load_timeout: float = 300.0,
        drain_timeout: float = 120.0,
        default_policy: str = "keep",
        broadcast: bool = False,
        memmap_chunks_in_flight: int = 3,
        swap_overlap: bool = False,
        overlap_lead_s: float = 0.035,
        overlap_commit_timeout: float = 0.25,
        overlap_programs: int = 0,
    ):
        self.consumer = consumer
        self.engine = consumer.engine
        self.root = root
        self.reconcile_interval = reconcile_interval
        self.load_timeout = load_timeout
        self.drain_timeout = drain_timeout
        self.default_policy = default_policy
        #: Memmap reads to the GPU: 256 MiB chunks queued at most this many at a time (0: all
        #: at once, faster but it stalls generation; see rollq.weightsync.memmap.MemmapStore).
        self.memmap_chunks_in_flight = memmap_chunks_in_flight
        #: ``keep`` policy, broadcast received in place by a one-worker replica: stop
        #: generation ``overlap_lead_s`` before the receive is expected to end (this replica's
        #: last in-place receive times) and swap each part in as it completes, instead of
        #: swapping the whole version after the commit (see ``rollq_swap_overlapped``).
        #: Generation then stands still for about the lead plus the commit; end to end, the
        #: swap's copies and the wait for a step boundary leave the update's path. The lead
        #: should cover one engine step plus exchanging the weights (each byte read and
        #: written on both sides): 35 ms for 15.2 GB on an H200 (benchmarks/README.md: 59.7 ms
        #: end to end with 40 ms stopped, against 70-72 ms and 13-15 ms without overlap).
        self.swap_overlap = swap_overlap
        self.overlap_lead_s = overlap_lead_s
        self.overlap_commit_timeout = overlap_commit_timeout
        #: Cap on the exchange kernel's concurrent blocks (0: none; see rollq_swap_overlapped).
        self.overlap_programs = overlap_programs
        self.history: list[UpdateStats] = []
        #: Overlapped swaps undone (the receive failed, or no commit came in time).
        self.overlap_reverts = 0
        self.failures = 0
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: Any = None
        self._hinted = 0  # newest version announced on pub/sub (its acks are read with the record)
        self._hinted_at = 0.0  # when that announcement arrived (wall clock)
        self._load_call_s = 0.0
        self._policy: str | None = None  # the queue's update policy as last read
        self._receive_est: float | None = None  # this replica's in-place receive time (EWMA, s)
        self._overlap_task: asyncio.Task | None = None
        #: NCCL/gloo receiver (rollq.weightsync.nccl) that stages versions while serving.
        self.receiver: Any = None
        if broadcast:
            from .nccl import ReplicaReceiver

            self.receiver = ReplicaReceiver(self)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Catch up with the committed version (before the consumer pulls), then follow it."""
        from ..connection import connect

        self._client = connect(self.consumer.redis_settings)
        self.consumer.add_control_handler(self._on_control)
        self.consumer.intake_gate.clear()  # a restarted replica loads the current version first
        try:
            await self._reconcile_with_retry()
        finally:
            self.consumer.intake_gate.set()
        self._task = asyncio.create_task(self._loop(), name="rollq-weight-follower")
        if self.receiver is not None:
            await self.receiver.start(self._client)

    async def stop(self) -> None:
        if self._overlap_task is not None:
            self._overlap_task.cancel()
            await asyncio.gather(self._overlap_task, return_exceptions=True)
        if self.receiver is not None:
            await self.receiver.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _on_control(self, verb: str, arg: str) -> None:
        if verb == "woffer" and self._can_overlap():
            try:
                v = int(arg.split()[0])
            except (ValueError, IndexError):
                return
            if v > self.consumer.version and (self._overlap_task is None or self._overlap_task.done()):
                self._overlap_task = asyncio.create_task(self._overlap(v, time.monotonic()), name="rollq-overlapped-swap")
        elif verb == "version":
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
            try:
                await asyncio.wait_for(self._kick.wait(), self.reconcile_interval)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.failures += 1
                log.error("weight update failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(min(5.0, 0.2 * self.failures))

    # -- applying versions ---------------------------------------------------------------
    async def reconcile(self) -> UpdateStats | None:
        """Apply the committed version if it is newer than the loaded one."""
        async with self._lock:
            t0 = time.perf_counter()
            # One round trip: the record, the policy and (for an announced broadcast version)
            # this replica's acks; every await here waits behind a busy consumer's event loop.
            keys = self.consumer.keys
            pipe = self._client.pipeline(transaction=False)
            pipe.hget(keys.version, "d")
            pipe.hget(keys.config, "update_policy")
            hinted = self._hinted if self.receiver is not None and self._hinted > self.consumer.version else 0
            if hinted:
                pipe.hmget(keys.weights_acks(hinted), self.receiver.fields())
            got = await pipe.execute()
            rec = decode_record(got[0]) if got[0] else None
            if rec is None or rec.version <= self.consumer.version:
                return None
            p = got[1].decode() if isinstance(got[1], bytes) else got[1]
            policy = self._policy = p if p in POLICIES else self.default_policy
            acks = got[2] if hinted and hinted == rec.version else None
            self._note_receive(acks)
            read_s = time.perf_counter() - t0
            st = await self.apply(rec, policy, acks=acks)
            st.timings.update(read_s=read_s, hinted_at=self._hinted_at if self._hinted == rec.version else 0.0)
            self.history.append(st)
            self.failures = 0
            return st

    # -- swap overlapped with the receive ---------------------------------------------------
    def _can_overlap(self) -> bool:
        return (self.swap_overlap and self.receiver is not None and self.receiver.num_workers == 1
                and self._policy == "keep" and self._receive_est is not None)

    def _note_receive(self, acks: list[Any] | None) -> None:
        """Learn how long this replica's in-place receives take, from its ack
        (``ok <receive_s> <verify_s> in-place ...``)."""
        parts = acks[0].split() if acks and len(acks) == 1 and acks[0] else []
        if len(parts) >= 4 and parts[0] == b"ok" and parts[3] == b"in-place":
            self._learn_receive(float(parts[1]))

    def _learn_receive(self, t: float) -> None:
        self._receive_est = t if self._receive_est is None else 0.7 * self._receive_est + 0.3 * t

    async def _overlap(self, version: int, t_offer: float) -> None:
        """Announced offer ``version``: shortly before its receive should end, stop and swap
        it in part by part (``rollq_swap_overlapped``); if that does not happen (not received
        in place, receive failed, no commit in time) the usual path applies it once committed."""
        c = self.consumer
        try:
            await asyncio.sleep(max(0.0, t_offer + (self._receive_est or 0.0) - self.overlap_lead_s - time.monotonic()))
            async with self._lock:
                if c.version >= version or not self._can_overlap():
                    return
                t0 = time.perf_counter()
                with self._intake_closed():
                    res = await asyncio.wait_for(
                        self.engine.call_workers("rollq_swap_overlapped", version, self.overlap_commit_timeout,
                                                 5.0, 0.05, self.overlap_programs),
                        self.load_timeout,
                    )
                    got = res[0] if res else {}
                    if got.get("swap") == "overlap":
                        self._set_version(version)
                        self.engine.new_cache_salt()
                pause_s = time.perf_counter() - t0
                if got.get("swap") != "overlap":
                    self.overlap_reverts += got.get("swap") == "reverted"
                    log.info("version %d: no overlapped swap (%s); it is applied once committed", version, got.get("why"))
                    return
                if got.get("receive_s"):
                    self._learn_receive(got["receive_s"])
                self.history.append(self._updated(UpdateStats(
                    version, "keep", "nccl", time.monotonic() - t_offer, pause_s, got,
                    timings={"load_call_s": pause_s, "read_s": 0.0, "hinted_at": 0.0},
                )))
                self.failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the usual path still applies the version once committed
            log.warning("overlapped swap of version %d failed: %s: %s", version, type(e).__name__, e)

    async def apply(self, rec: VersionRecord, policy: str, acks: list[Any] | None = None) -> UpdateStats:
        c = self.consumer
        t0 = time.perf_counter()
        staged = None
        if self.receiver is not None and rec.transport == "nccl":
            # received while serving; only the swap is left
            staged = await self.receiver.staged_for(rec, acks=acks)
            if staged is None and rec.memmap_slot is None:
                # Committed before this replica acked (it joined late, or the trainer moved on):
                # wait briefly for a memmap copy rather than failing.
                log.info("version %d was broadcast without us; waiting for a memmap copy", rec.version)
        if staged is None and rec.memmap_slot is not None and self.root is not None:
            # Read, copy and verify while still serving; the pause below only swaps it in.
            staged = await self._stage_memmap(rec)
        aborted: list[Any] = []
        with self._intake_closed():
            try:
                if policy == "drain":
                    t_pause = time.perf_counter()
                    await self._wait_drained()
                    load = await self._load(rec, staged)
                    self._set_version(rec.version)
                    await self.engine.reset_prefix_cache()
                elif policy == "keep":
                    t_pause = time.perf_counter()  # generation stops for at most this long
                    load = await self._load(rec, staged)
                    self._set_version(rec.version)
                    # Requests are running (keep), so vLLM would refuse to drop its cache: new
                    # requests get a fresh salt instead and never reuse a prefix of the old weights.
                    self.engine.new_cache_salt()
                else:
                    aborted = c.abort_running()
                    t_pause = time.perf_counter()
                    await self.engine.pause("abort")
                    try:
                        load = await self._load(rec, staged)
                        self._set_version(rec.version)
                        await self.engine.reset_prefix_cache()
                    finally:
                        await self.engine.resume()
                pause_s = time.perf_counter() - t_pause
            finally:
                if aborted:  # before intake reopens
                    c.restart(aborted)
        return self._updated(UpdateStats(rec.version, policy, rec.transport, time.perf_counter() - t0, pause_s, load,
                                         timings={"load_call_s": self._load_call_s}))

    @contextlib.contextmanager
    def _intake_closed(self) -> Iterator[None]:
        """rollq's own intake closed (vLLM would still accept) and the replica shown paused
        while an update is swapped in; reads that arrived meanwhile are released after."""
        c = self.consumer
        c.intake_gate.clear()
        state_before, c.state = c.state, "paused"
        try:
            yield
        finally:
            c.state = state_before if state_before != "paused" else "serving"
            c.intake_gate.set()
            c.release_held()

    def _updated(self, st: UpdateStats) -> UpdateStats:
        """Account for an applied update on the consumer (status, paused total) and log it."""
        c = self.consumer
        c._paused_total += st.pause_s
        c.update_info = {
            "last_update_s": round(st.update_s, 4), "last_pause_s": round(st.pause_s, 4),
            "updates": c.update_info.get("updates", 0) + 1,
        }
        log.info(
            "replica %s now at policy version %d (%s, %s%s): update %.3fs, paused %.3fs",
            c.id, st.version, st.policy, st.transport, ", swapped in while arriving" if st.load.get("swap") == "overlap" else "",
            st.update_s, st.pause_s,
        )
        return st

    def _set_version(self, v: int) -> None:
        self.consumer.version = v
        self.consumer.release_held()

    async def _wait_drained(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.consumer.running_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _stage_memmap(self, rec: VersionRecord) -> Any:
        """Have every worker stage ``rec`` in a thread of its own, polling until all did."""
        started = await asyncio.wait_for(
            self.engine.call_workers(
                "rollq_stage_memmap", self.root, rec.memmap_slot, rec.version, rec.checksum, self.memmap_chunks_in_flight
            ),
            self.load_timeout,
        )
        if not started:  # an engine without weights (echo): nothing to stage
            return None
        deadline = time.monotonic() + self.load_timeout
        delay = 0.005
        while True:
            states = await self.engine.call_workers("rollq_staged_status")
            if all(s.get("state") == "staged" and s.get("version") == rec.version for s in states):
                return ("memmap", rec.version, {k: v for k, v in states[0].items() if k not in ("state", "version")})
            bad = [s for s in states if s.get("state") == "failed" or (s.get("version") not in (None, rec.version))]
            if bad:
                msg = "; ".join(str(s.get("error", s)) for s in bad)
                if any(s.get("corrupt") for s in bad):
                    raise CorruptWeights(f"version {rec.version} refused: {msg}")
                raise WeightSyncError(f"staging version {rec.version} failed: {msg}")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"staging version {rec.version} took longer than {self.load_timeout}s (load_timeout)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    async def _load(self, rec: VersionRecord, staged: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return await self._load_now(rec, staged)
        finally:
            self._load_call_s = time.perf_counter() - t0

    async def _load_now(self, rec: VersionRecord, staged: Any) -> dict[str, Any]:
        if isinstance(staged, tuple) and staged[0] == "memmap":
            try:
                res = await asyncio.wait_for(self.engine.call_workers("rollq_apply_staged", staged[1]), self.load_timeout)
            except asyncio.TimeoutError as e:
                raise WeightSyncTimeout(f"swapping in version {rec.version} took longer than {self.load_timeout}s") from e
            return dict(staged[2], **(res[0] if res else {}))
        if staged is not None:
            return await self.receiver.apply_staged(rec, staged, timeout=self.load_timeout)
        if rec.memmap_slot is None:
            raise WeightSyncError(
                f"version {rec.version} was sent over {rec.transport} and this replica did not receive it; "
                "no memmap copy is recorded yet"
            )
        if self.root is None:
            raise WeightSyncError("version is in memmap storage but this replica has no weights root (--weights-root)")
        try:
            res = await asyncio.wait_for(
                self.engine.call_workers("rollq_load_memmap", self.root, rec.memmap_slot, rec.version, rec.checksum),
                self.load_timeout,
            )
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(
                f"loading version {rec.version} from memmap took longer than {self.load_timeout}s (load_timeout)"
            ) from e
        except Exception as e:
            from .worker_ext import CORRUPT_TAG

            if isinstance(e, CorruptWeights) or CORRUPT_TAG in str(e):
                raise CorruptWeights(f"version {rec.version} refused: {e}") from e
            raise
        return res[0] if res else {}
