"""The replica side: pull jobs sized to free capacity, run them, finish them exactly once.

>>> async def main():                                               # doctest: +SKIP
...     consumer = Consumer(EchoEngine(), url="redis://127.0.0.1:6379/0", queue="grpo")
...     await consumer.run()                 # until SIGTERM / stop(); burst=True drains and returns

:class:`Consumer` wires a pipeline of parts that share one
:class:`~rollq.consumer._context.ReplicaContext`; each loop is one asyncio task:

- **pull** (:mod:`~rollq.consumer._puller`): ``XREADGROUP COUNT=free`` over this replica's
  targeted stream and the shared stream of its home shard, and the other shards' shared
  streams in turn (a sharded queue, :mod:`rollq.shards`); each entry is admitted into the
  :mod:`~rollq.consumer._jobs` in hand (decoded, validated, handed to the engine). Jobs wait in
  Redis, not here.
- **finish** (:mod:`~rollq.consumer._finisher`): engine outcomes are batched into one FINISH
  script call per shard (results + XACK + delete the entries + forget the ids, each refused if its entry
  is no longer pending), shielded from cancellation and retried across Redis outages.
- **heartbeat** (:mod:`~rollq.consumer._lease`): renews this replica's lease key (one in
  every shard), publishes its
  registry entry, notices cancellations of running jobs, feeds the capacity controller.
- **reclaim** (:mod:`~rollq.consumer._reclaimer`): recovers this replica's own entries that a
  lost read reply left pending; the one replica holding a shard's reclaimer role finds
  consumers whose lease expired and takes over their pending jobs in that shard; after
  ``max_deliveries`` a job is dead-lettered instead.
- **control** (:mod:`~rollq.consumer._control`): pub/sub hints (cancel, hand-back) that make
  the above react at once.
- **version wait** (:mod:`~rollq.consumer._versions`): jobs whose ``min_version`` is above the
  loaded policy version wait outside the in-flight cap until it loads, or fail with
  :class:`~rollq.errors.VersionUnavailable`.

Weight sync (:mod:`rollq.weightsync.replica.follower`) drives the replica only through the methods
under "the seam weight sync drives" below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
import uuid
from typing import Any, Callable, Iterator

from .._tasks import stop_task
from ..connection import RETRYABLE, connect, load_scripts, raw_replies
from ..keys import QueueKeys, check_name
from ..protocol import LATENCY_BUCKETS_MS, Control, ReplicaInfo, latency_bucket
from ..settings import DEFAULT_QUEUE, ConsumerSettings, RedisSettings
from ..shards import declare_shards
from .capacity import CapacityController
from ._context import ConsumerCounters, ReplicaContext
from ._control import ControlListener
from .engine import Engine, SwapProgress
from ._finisher import FINISH_BATCH_BYTES, Finisher, batch_rows
from ._in_hand import Failure, JobInHand
from ._jobs import Jobs
from ._lease import Lease
from ._puller import Puller
from ._reclaimer import Reclaimer
from ._versions import VersionWait

__all__ = [
    "Consumer", "ConsumerCounters", "Failure", "JobInHand", "ReplicaInfo",
    "FINISH_BATCH_BYTES", "LATENCY_BUCKETS_MS", "batch_rows",
]

log = logging.getLogger(__name__)

# Names this module had before the parts moved out (tests and benchmarks import them).
_bucket = latency_bucket


class Consumer:
    """One replica: an engine, fed from a queue.

    Args:
        engine: what generates (``EchoEngine``, ``VllmEngine``, ...).
        url: Redis URL (``$ROLLQ_REDIS_URL`` if None).
        queue: queue name.
        consumer_id: this replica's name (also its targeted stream); random if None.
        settings: :class:`~rollq.settings.ConsumerSettings`.
    """

    def __init__(
        self,
        engine: Engine,
        url: str | RedisSettings | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        consumer_id: str | None = None,
        settings: ConsumerSettings | None = None,
    ):
        self.engine = engine
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.keys = QueueKeys(queue)
        self.queue = queue
        self.id = check_name("consumer", consumer_id or f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:8]}")
        self.settings = settings or ConsumerSettings()
        ctx = self._ctx = ReplicaContext(
            id=self.id, queue=queue, keys=self.keys, settings=self.settings, redis_settings=self.redis_settings,
            engine=engine, counters=ConsumerCounters(), capacity=self._make_capacity(),
        )
        #: Set while jobs may start (:meth:`close_intake` / :meth:`open_intake`).
        self.intake_gate: asyncio.Event = ctx.intake
        self._stopping = ctx.stopping
        self._tasks: list[asyncio.Task] = []
        self.finisher = Finisher(ctx)
        self.versions = VersionWait(ctx, self.finisher)
        self.jobs = Jobs(ctx, self.finisher, self.versions)
        self.puller = Puller(ctx, self.jobs, self.finisher)
        self.lease = Lease(ctx, self.jobs)
        self.reclaimer = Reclaimer(ctx, self.jobs, self.puller.recover_own)
        self.control = ControlListener(ctx, self.jobs, self.reclaimer.now.set)

    # -- state the parts share, as attributes ----------------------------------------------
    @property
    def version(self) -> int:
        """Loaded policy version (weight sync sets it through :meth:`set_version`)."""
        return self._ctx.version

    @version.setter
    def version(self, v: int) -> None:
        self._ctx.version = v

    @property
    def converted_from(self) -> list[str]:
        """dtypes of the served policy version that the engine converts to its own
        (``Engine.dtype``); weight sync sets it, the registry shows it."""
        return self._ctx.converted_from

    @converted_from.setter
    def converted_from(self, dtypes: list[str]) -> None:
        self._ctx.converted_from = list(dtypes)

    @property
    def state(self) -> str:
        """``starting | serving | paused | draining | stopped``."""
        return self._ctx.state

    @state.setter
    def state(self, s: str) -> None:
        self._ctx.state = s

    @property
    def counters(self) -> ConsumerCounters:
        return self._ctx.counters

    @counters.setter
    def counters(self, c: ConsumerCounters) -> None:
        self._ctx.counters = c

    @property
    def capacity(self) -> CapacityController:
        return self._ctx.capacity

    @capacity.setter
    def capacity(self, c: CapacityController) -> None:
        self._ctx.capacity = c

    @property
    def shards(self) -> int:
        """How many shards of the queue this replica serves: the queue's recorded count once
        it runs (1 for an unsharded queue); it grows when the record does."""
        return len(self._ctx.shards)

    @property
    def exit_code(self) -> int:
        """What :meth:`run` returns: 0, or 1 if the engine died."""
        return 0 if self._ctx.engine_error is None else 1

    # -- lifecycle -------------------------------------------------------------------------
    def _make_capacity(self) -> CapacityController:
        """Size the in-flight cap from the settings, else from the engine's own limit."""
        s = self.settings
        hint = self.engine.capacity_hint()
        maximum = s.max_inflight or (int(hint * 1.25) + 8 if hint else 256)
        initial = s.initial_inflight or (hint + 8 if hint else 64)
        return CapacityController(initial=min(initial, maximum), maximum=maximum, adaptive=s.adaptive)

    async def run(self, *, burst: bool = False, install_signal_handlers: bool = False) -> int:
        """Serve until :meth:`stop` (or SIGTERM with ``install_signal_handlers``).

        With ``burst`` return once the queue is drained and nothing is running. Returns the
        exit code: 0, or 1 if the engine died.
        """
        self._ctx.burst = burst
        if install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        self.capacity = self._make_capacity()  # the engine is started now: its limits are known
        await self._connect()
        try:
            await self._setup_redis()
        except BaseException:
            await self._close_clients()
            raise
        self.state = "serving"
        self._tasks = [
            asyncio.create_task(self.finisher.run(), name="rollq-finish"),
            asyncio.create_task(self.lease.run(), name="rollq-heartbeat"),
            asyncio.create_task(self.reclaimer.run(), name="rollq-reclaim"),
            asyncio.create_task(self.control.run(), name="rollq-control"),
            asyncio.create_task(self.versions.run(), name="rollq-version-wait"),
        ]
        log.info("consumer %s serving queue %r with engine %s (%s)", self.id, self.queue, self.engine.name, self.engine.model)
        try:
            await self.puller.recover_own(min_idle=0)  # a restart under the same id resumes its own leased jobs
            await self.puller.run()
        finally:
            await self._shutdown()
        return self.exit_code

    def stop(self) -> None:
        """Stop pulling; finish running jobs within ``drain_timeout``; hand back the rest."""
        self._ctx.stop(len(self.jobs.running))

    async def _connect(self) -> None:
        ctx = self._ctx
        ctx.redis = connect(self.redis_settings)
        # The hot paths (reads, FINISH) use clients without socket timeouts, bounded by
        # deadline() instead (see rollq.connection: fewer event-loop turns per command).
        ctx.block_redis = connect(self.redis_settings, socket_timeout=None, max_connections=4)
        ctx.finish_redis = connect(self.redis_settings, socket_timeout=None, max_connections=4)
        # Reads take the reply as Redis sent it: the puller walks the flat reply itself
        # instead of letting redis-py build a dict per entry.
        raw_replies(ctx.block_redis, "XREADGROUP")

    async def _setup_redis(self) -> None:
        """Agree on the queue's shards, create the groups this replica reads, register.

        Raises:
            ShardCountMismatch: ``settings.shards`` names another count than the queue's record.
        """
        ctx = self._ctx
        backoff = self.settings.backoff_initial
        while True:
            try:
                await load_scripts(ctx.redis)
                ctx.set_shards(await declare_shards(ctx.redis, self.keys, self.settings.shards))
                for stream in ctx.read_streams():
                    await ctx.ensure_group(stream)
                await self.lease.register()  # prunes stale queue names too; the first heartbeat
                return
            except RETRYABLE as e:
                log.warning("redis unavailable at start (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.backoff_max)

    async def _shutdown(self) -> None:
        """Wait (bounded) for running jobs, hand back the rest, record what finished, stop the
        background tasks and release the lease."""
        ctx, jobs = self._ctx, self.jobs
        until = time.monotonic() + (0 if ctx.engine_error else self.settings.drain_timeout)
        while (jobs.running or jobs.held) and time.monotonic() < until and not ctx.engine_error:
            await asyncio.sleep(0.02)
        unfinished = len(jobs.running) + len(jobs.held) + len(self.versions.waiting)
        if unfinished:  # jobs waiting for a version are not waited for
            log.warning("consumer %s handing back %d unfinished jobs", self.id, unfinished)
        jobs.hand_back()
        await jobs.progress.close()
        await self.finisher.drain(max(5.0, self.settings.drain_timeout / 5))  # bounded even if Redis is down
        ctx.closed = True  # every background loop ends at its next turn, even if a cancel is lost
        # bounded: a task that swallows its cancellation is cancelled again, and never hangs shutdown
        stopped = await asyncio.gather(*(stop_task(t, grace=5.0) for t in self._tasks))
        if not all(stopped):
            log.warning("consumer %s: %d background task(s) ignored cancellation", self.id, stopped.count(False))
        self.state = "stopped"
        try:
            await self.reclaimer.resign()
        except RETRYABLE:
            pass  # the role expires after lease_ttl
        await self.lease.release(leave_group=not jobs.running and not jobs.held and not len(self.finisher))
        await self._close_clients()
        log.info("consumer %s stopped (%d completed, %d failed)", self.id, self.counters.completed, self.counters.failed)

    async def _close_clients(self) -> None:
        ctx = self._ctx
        for c in (ctx.redis, ctx.block_redis, ctx.finish_redis):
            if c is not None:
                await c.aclose()

    # -- pull, reclaim -----------------------------------------------------------------------
    def add_control_handler(self, cb: Callable[[Control, str], Any]) -> None:
        """Call ``cb(verb, arg)`` for every control message of a known verb (weight sync uses it)."""
        self.control.add_handler(cb)

    def info(self) -> ReplicaInfo:
        """This replica's registry entry as of now."""
        return self.lease.entry()

    async def announce(self) -> None:
        """Write this replica's registry entry now, not at the next heartbeat (the weight
        follower calls it after an update, so ``wait_for_replicas`` sees it at once)."""
        if self._ctx.redis is None or self._ctx.closed or self.state in ("starting", "stopped"):
            return
        await self.lease.announce()

    # -- the seam weight sync drives (rollq.weightsync.replica.follower) ---------------------------
    def close_intake(self) -> None:
        """Stop starting jobs: reads that arrive are held until :meth:`open_intake`."""
        self.intake_gate.clear()

    def open_intake(self) -> None:
        """Start jobs again, first those held meanwhile (:meth:`release_held`)."""
        self.intake_gate.set()
        self.release_held()

    @contextlib.contextmanager
    def paused_for_update(self) -> Iterator[None]:
        """Intake closed and the replica shown ``paused`` while a weight update is swapped
        in; the previous state and intake come back after."""
        self.close_intake()
        state_before, self.state = self.state, "paused"
        try:
            yield
        finally:
            self.state = state_before if state_before != "paused" else "serving"
            self.open_intake()

    def record_update(self, update_s: float, pause_s: float) -> None:
        """Account for an applied weight update in the registry entry (last update and
        pause, count, total paused)."""
        ctx = self._ctx
        ctx.paused_s_total += pause_s
        ctx.update_info = {
            "last_update_s": round(update_s, 4), "last_pause_s": round(pause_s, 4),
            "updates": ctx.update_info.get("updates", 0) + 1,
        }

    def set_version(self, version: int, progress: SwapProgress | None = None) -> None:
        """The engine now serves ``version`` (weight sync calls this once the new weights are
        in). ``progress`` says how many tokens each running request had generated before the
        swap: every sample's result then records where each version began
        (:attr:`~rollq.protocol.Sample.versions`); without it those starts are unknown."""
        if version != self.version:
            self.jobs.mark_swap(version, progress)
            # No request handed to the engine from here on reuses a prefix cached under the
            # old weights (those already in it keep their salt; mark_swap restarted the ones
            # that had no token yet).
            self._ctx.engine.new_cache_salt()
        self.version = version
        self.jobs.end_swap()
        self.jobs.submit_restarted()
        self.release_held()

    @contextlib.contextmanager
    def swapping(self) -> Iterator[None]:
        """Around a weight swap into the engine: from here until :meth:`set_version` records
        the new version, outputs that arrive are held back (their last tokens may already
        come from the new weights). If the swap fails, the held outputs are finished as
        they are."""
        self.jobs.begin_swap()
        try:
            yield
        finally:
            if self.jobs.swap_pending:  # no set_version: the swap did not happen
                self.jobs.end_swap()
                self.jobs.submit_restarted()

    def release_held(self) -> None:
        """Start jobs held while intake was closed and those waiting for the policy version
        now loaded (the weight follower calls it after every update)."""
        self.jobs.release()

    def running_count(self) -> int:
        return len(self.jobs.running)

    def abort_running(self) -> list[JobInHand]:
        """Abort every running request in the engine; the jobs stay leased to this replica.

        Returns them for :meth:`restart` (weight sync's ``abort`` policy).
        """
        return self.jobs.abort_running()

    def collect_partials(self) -> None:
        """Before the engine ends every running request (``pause("abort")``): keep each
        one's output so far for a resume instead of finishing it (weight sync's ``abort``
        policy with ``WeightSyncSettings.abort_resume``; :mod:`rollq.consumer._resume`)."""
        self.jobs.collect_partials()

    async def partials(self, timeout: float) -> list[JobInHand]:
        """The jobs whose requests the engine ended since :meth:`collect_partials`, with
        their outputs so far, for :meth:`restart` (waits at most ``timeout`` seconds)."""
        return await self.jobs.partials(timeout)

    def parked_jobs(self) -> list[JobInHand]:
        """The jobs parked for a weight update so far (to restart when it fails midway)."""
        return list(self.jobs.parked)

    def restart(self, jobs: list[JobInHand]) -> None:
        """Run jobs returned by :meth:`abort_running` or :meth:`partials` again: from their
        partial output where they have one that may be resumed, else from scratch."""
        self.jobs.restart(jobs)

    def version_failed(self, version: int, reason: str) -> None:
        """This replica cannot load committed policy ``version`` and will not retry it until a
        newer one is committed (the weight follower calls it). Jobs waiting for a version it
        would have served (``min_version <= version``) fail with
        :class:`~rollq.errors.VersionUnavailable` naming ``reason``, once Redis confirms that
        no newer version is committed; later versions are waited for as usual.

        >>> consumer.version_failed(7, "WeightMismatch: 1 shape mismatch ...")   # doctest: +SKIP
        """
        self.versions.version_failed(version, reason)
