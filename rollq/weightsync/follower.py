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

On start the follower publishes the checkpoint manifest of the served model (names, dtypes,
shapes from the model folder's safetensors headers; :mod:`rollq.weightsync.manifest`), which
publishers check state dicts against, and checks each memmap version's manifest against it
before loading. A version that cannot be loaded is recorded in ``QueueKeys.load_errors``
(:class:`~rollq.weightsync.versions.LoadError`, removed once a version loads) and is not
retried every second: a corrupt or mismatched version (:class:`~rollq.errors.CorruptWeights`,
:class:`~rollq.errors.WeightMismatch`) never again, other failures ``load_retries`` times
with a doubling delay from ``load_retry_delay``; after that the follower waits for a newer
version and tells the consumer (``Consumer.version_failed``), which fails jobs waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..connection import RETRYABLE
from ..errors import CorruptWeights, WeightMismatch, WeightSyncError, WeightSyncTimeout
from ..protocol import Control
from .manifest import Manifest, diff, encode_manifest, read_manifest
from .versions import LoadError, TensorMeta, VersionRecord, decode_record, report_load_error

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


@dataclass
class _Failure:
    """This replica's failure to load one committed version."""

    version: int
    attempts: int
    final: bool  # not retried until a newer version is committed
    retry_at: float  # monotonic


#: Longest delay between two attempts at a version that failed to load.
MAX_RETRY_DELAY = 60.0


class WeightFollower:
    """Keeps one replica's engine at the newest committed policy version.

    ``load_retries``: attempts after the first at a version whose load failed for a reason
    other than corrupt or mismatched data, ``load_retry_delay`` seconds apart at first,
    doubling (at most 60 s).
    """

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
        load_retries: int = 3,
        load_retry_delay: float = 2.0,
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
        self.load_retries = load_retries
        self.load_retry_delay = load_retry_delay
        #: Checkpoint manifest of the served model (None: the engine has no model folder).
        self.manifest: Manifest | None = None
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
        self._failure: _Failure | None = None
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
        await self._publish_manifest()
        self.consumer.add_control_handler(self._on_control)
        self.consumer.close_intake()  # a restarted replica loads the current version first
        try:
            await self._reconcile_with_retry()
            if self._failure is None:  # an entry left by an earlier run under this id
                await self._clear_failure()
        finally:
            self.consumer.open_intake()
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
            try:  # a stopped replica serves nothing: its manifest and load error go with it
                pipe = self._client.pipeline(transaction=False)
                pipe.hdel(self.consumer.keys.manifests, self.consumer.id)
                pipe.hdel(self.consumer.keys.load_errors, self.consumer.id)
                await pipe.execute()
            except RETRYABLE as e:
                log.debug("could not remove this replica's manifest (%s)", e)
            await self._client.aclose()

    async def _publish_manifest(self) -> None:
        """Read the served checkpoint's manifest (headers only) and publish it for publishers."""
        model = getattr(self.engine, "model", "") or ""
        dtype = getattr(getattr(self.engine, "config", None), "dtype", None)
        try:
            self.manifest = await asyncio.to_thread(read_manifest, model, dtype if isinstance(dtype, str) else None)
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
            if v > self.consumer.version and (self._overlap_task is None or self._overlap_task.done()):
                self._overlap_task = asyncio.create_task(self._overlap(v, time.monotonic()), name="rollq-overlapped-swap")
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
            wait = self.reconcile_interval
            f = self._failure
            if f is not None and not f.final:  # wake for the retry
                wait = max(0.0, min(wait, f.retry_at - time.monotonic()))
            try:
                await asyncio.wait_for(self._kick.wait(), wait)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                await self._reconcile(from_loop=True)
                f = self._failure
                if f is not None and self.consumer.version >= f.version:  # loaded meanwhile (overlapped swap)
                    await self._clear_failure()
            except asyncio.CancelledError:
                raise
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
            f = self._failure
            if from_loop and f is not None and f.version == rec.version and (f.final or time.monotonic() < f.retry_at):
                return None
            p = got[1].decode() if isinstance(got[1], bytes) else got[1]
            policy = self._policy = p if p in POLICIES else self.default_policy
            acks = got[2] if hinted and hinted == rec.version else None
            self._note_receive(acks)
            read_s = time.perf_counter() - t0
            try:
                self._check_slot(rec)
                st = await self.apply(rec, policy, acks=acks)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await self._load_failed(rec.version, e)
                if from_loop:
                    return None
                raise
            st.timings.update(read_s=read_s, hinted_at=self._hinted_at if self._hinted == rec.version else 0.0)
            self.history.append(st)
            self.failures = 0
            if self._failure is not None:
                await self._clear_failure()
            await self.consumer.announce()  # waiters (wait_for_replicas) see the version now
            return st

    # -- load failures ------------------------------------------------------------------------
    def _check_slot(self, rec: VersionRecord) -> None:
        """Refuse a memmap version whose tensors do not match the served checkpoint before
        the engine sees any of it (the publisher checks too, unless told not to)."""
        if self.manifest is None or rec.memmap_slot is None or self.root is None:
            return
        from .memmap import MemmapStore

        marker = MemmapStore(self.root).marker(rec.memmap_slot)
        if not marker or marker.get("version") != rec.version:
            return  # the load itself refuses it (CorruptWeights)
        problems = diff([TensorMeta(n, d, list(sh)) for n, d, sh in marker.get("manifest", [])], self.manifest)
        if problems:
            raise WeightMismatch(problems.describe(f"policy version {rec.version} ({rec.memmap_slot})", self.manifest.model), mismatch=problems)

    async def _load_failed(self, version: int, e: Exception) -> None:
        """Record why ``version`` did not load, here and in Redis; decide whether to retry it."""
        c = self.consumer
        f = self._failure
        attempts = f.attempts + 1 if f is not None and f.version == version else 1
        final = isinstance(e, (CorruptWeights, WeightMismatch)) or attempts > self.load_retries
        delay = min(MAX_RETRY_DELAY, self.load_retry_delay * 2 ** (attempts - 1))
        self._failure = _Failure(version, attempts, final, time.monotonic() + delay)
        msg = str(e)[:2000]
        if final:
            log.error(
                "replica %s cannot load policy version %d (%s: %s); it keeps serving version %d and waits for a newer one",
                c.id, version, type(e).__name__, msg[:500], c.version,
            )
        else:
            log.warning(
                "replica %s could not load policy version %d (%s: %s); retry %d of %d in %.1fs (WeightFollower load_retries)",
                c.id, version, type(e).__name__, msg[:500], attempts, self.load_retries, delay,
            )
        try:
            await report_load_error(self._client, c.keys, c.id, LoadError(
                version=version, error=type(e).__name__, message=msg, attempts=attempts, final=final,
            ))
        except RETRYABLE as re:
            log.warning("could not record the load error of version %d in Redis (%s)", version, re)
        if final:
            c.version_failed(version, f"{type(e).__name__}: {msg[:500]}")

    async def _clear_failure(self) -> None:
        self._failure = None
        try:
            await self._client.hdel(self.consumer.keys.load_errors, self.consumer.id)
        except RETRYABLE as e:
            log.debug("could not remove this replica's load error (%s)", e)

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
                with self.consumer.paused_for_update():
                    res = await asyncio.wait_for(
                        self.engine.call_workers("rollq_swap_overlapped", version, self.overlap_commit_timeout,
                                                 5.0, 0.05, self.overlap_programs),
                        self.load_timeout,
                    )
                    got = res[0] if res else {}
                    if got.get("swap") == "overlap":
                        self._set_version(version, got)
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
        with self.consumer.paused_for_update():
            try:
                if policy == "drain":
                    t_pause = time.perf_counter()
                    await self._wait_drained()
                    load = await self._load(rec, staged)
                    self._set_version(rec.version, load)
                    await self.engine.reset_prefix_cache()
                elif policy == "keep":
                    t_pause = time.perf_counter()  # generation stops for at most this long
                    load = await self._load(rec, staged)
                    self._set_version(rec.version, load)
                    # Requests are running (keep), so vLLM would refuse to drop its cache: new
                    # requests get a fresh salt instead and never reuse a prefix of the old weights.
                    self.engine.new_cache_salt()
                else:
                    aborted = c.abort_running()
                    t_pause = time.perf_counter()
                    await self.engine.pause("abort")
                    try:
                        load = await self._load(rec, staged)
                        self._set_version(rec.version, load)
                        await self.engine.reset_prefix_cache()
                    finally:
                        await self.engine.resume()
                pause_s = time.perf_counter() - t_pause
            finally:
                if aborted:  # before intake reopens
                    c.restart(aborted)
        return self._updated(UpdateStats(rec.version, policy, rec.transport, time.perf_counter() - t0, pause_s, load,
                                         timings={"load_call_s": self._load_call_s}))

    def _updated(self, st: UpdateStats) -> UpdateStats:
        """Account for an applied update on the consumer (status, paused total) and log it."""
        c = self.consumer
        c.record_update(st.update_s, st.pause_s)
        log.info(
            "replica %s now at policy version %d (%s, %s%s): update %.3fs, paused %.3fs",
            c.id, st.version, st.policy, st.transport, ", swapped in while arriving" if st.load.get("swap") == "overlap" else "",
            st.update_s, st.pause_s,
        )
        return st

    def _set_version(self, v: int, load: dict[str, Any] | None = None) -> None:
        """The engine serves ``v`` now; ``load`` (the swap call's result) carries how far each
        running request had got, for the per-token versions of their results."""
        report = load.get("progress") if load else None
        self.consumer.set_version(v, self.engine.swap_progress(report))

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
