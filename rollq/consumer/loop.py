"""The replica side: pull jobs sized to free capacity, run them, finish them exactly once.

>>> async def main():                                               # doctest: +SKIP
...     consumer = Consumer(EchoEngine(), url="redis://127.0.0.1:6379/0", queue="grpo")
...     await consumer.run()                 # until SIGTERM / stop(); burst=True drains and returns

The pipeline, one asyncio task each:

- **pull**: ``XREADGROUP COUNT=free`` over this replica's targeted stream and the shared
  stream; decode, validate, hand to the engine. Jobs wait in Redis, not here.
- **finish**: engine outcomes are batched into one FINISH script call (results + XACK +
  delete the entries + forget the ids, each refused if its entry is no longer pending),
  shielded from cancellation and retried across Redis outages.
- **heartbeat**: renews this replica's lease key, publishes its registry entry, notices
  cancellations of running jobs, feeds the capacity controller.
- **reclaim**: finds consumers whose lease expired and takes over their pending jobs; after
  ``max_deliveries`` a job is dead-lettered instead.
- **control**: pub/sub hints (cancel, hand-back) that make the above react at once.
- **version wait**: jobs whose ``min_version`` is above the loaded policy version wait here,
  outside the in-flight cap (at most ``max_parked``; at that bound the replica stops pulling
  and the rest wait in Redis, where other replicas can take them). They start once the
  version loads, or fail with :class:`~rollq.errors.VersionUnavailable` when their version is
  beyond the newest committed one for ``max_uncommitted_wait``, when they waited
  ``max_version_wait`` in all, or when this replica cannot load the newest committed version
  (:meth:`Consumer.version_failed`) and that version would have served them.
"""

from __future__ import annotations

import asyncio
import contextlib
import bisect
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import msgpack
import msgspec
from redis.exceptions import ResponseError

from ..connection import DROP_EMPTY, FINISH, RECLAIM, Client, connect, deadline, load_scripts, raw_replies
from ..connection import RETRYABLE as _RETRYABLE
from ..errors import (
    DeadLettered,
    EngineDead,
    EngineFailed,
    InvalidJob,
    JobCancelled,
    JobExpired,
    JobRejected,
    ProtocolError,
    ResultTooLarge,
    VersionUnavailable,
)
from ..keys import FIELD, GROUP, QueueKeys, check_name
from ..protocol import (
    Control,
    DeadLetter,
    ErrorInfo,
    Job,
    UNKNOWN_START,
    Result,
    control_message,
    cut,
    decode_job,
    encode_dead_letter,
    encode_job,
    encode_result,
    parse_control,
    peek_id,
    short,
)
from ..registry import add_registration, register_queue
from ..settings import DEFAULT_QUEUE, ConsumerSettings, RedisSettings
from .capacity import CapacityController
from .engine import Engine, EngineOutput, SwapProgress

log = logging.getLogger(__name__)

_FIELD = FIELD.encode()

#: Latency histogram bucket upper bounds, milliseconds (last bucket: +inf).
LATENCY_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000, 120000, 300000)


class ReplicaInfo(msgspec.Struct, kw_only=True):
    """What a replica publishes in the registry every heartbeat."""

    id: str
    host: str
    pid: int
    engine: str
    model: str
    device: str
    version: int
    inflight: int
    cap: int
    kv_usage: float | None
    tokens_per_s: float
    completed: int
    failed: int
    started_at: float
    heartbeat_at: float
    state: str  # serving | paused | draining | stopped
    labels: dict[str, str] = {}
    paused_s_total: float = 0.0
    last_update_s: float | None = None  # last weight update: noticed -> serving the new version
    last_pause_s: float | None = None  # last weight update: generation stopped
    updates: int = 0
    #: Devices per replica (vLLM ``tensor_parallel_size``): the workers a weight broadcast reaches.
    tp_size: int = 1


@dataclass(slots=True)
class _Running:
    job: Job
    stream: str
    eid: bytes
    deliveries: int
    started: float
    version_start: int
    #: Versions swapped in while it ran: (version, tokens per sample before the swap, or
    #: None where not known, and whether a sample missing from them had none).
    swaps: list[tuple[int, dict[int, int] | None, bool]] | None = None


@dataclass(slots=True)
class _Waiting:
    """A job waiting for the policy version it needs (``job.min_version``)."""

    stream: str
    eid: bytes
    job: Job
    deliveries: int
    since: float  # monotonic
    beyond_since: float | None = None  # since when its version is known not to be committed


class _Finish(NamedTuple):
    """One pending FINISH: a result and/or a dead letter for one stream entry."""

    stream: str
    eid: bytes
    job_id: str  # '' unless the id is recorded (caller-chosen): FINISH forgets it
    reply: str | None
    result: bytes
    dead_letter: bytes
    counter: str
    latency_ms: float | None = None
    for_job: str = ""  # the job's id, whether recorded or not (to tell its submitter)


@dataclass
class ConsumerCounters:
    pulled: int = 0
    completed: int = 0
    failed: int = 0
    dead_lettered: int = 0
    refused_duplicates: int = 0
    reclaimed: int = 0
    reconnects: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_MS) + 1))
    lag: dict[int, int] = field(default_factory=dict)


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
        self.capacity = self._make_capacity()
        self.counters = ConsumerCounters()
        #: Loaded policy version (weight sync updates it).
        self.version = 0
        self.state = "starting"
        self.exit_code = 0

        self._own_stream = self.keys.replica_jobs(self.id)
        self._streams = [self._own_stream, self.keys.jobs]
        self._names = {k.encode(): k for k in self._streams}  # stream names as Redis replies them
        self._result_keys: dict[str, str] = {}  # producer id -> its result stream
        self._client: Client | None = None
        self._block_client: Client | None = None
        self._finish_client: Client | None = None
        self._running: dict[str, _Running] = {}  # request id -> job
        self._by_job: dict[str, str] = {}  # job id -> request id
        self._held: list[tuple[str, bytes, Job, int]] = []  # read while intake was closed (weight update)
        self._waiting: list[_Waiting] = []  # waiting for a newer policy version (outside the cap)
        self._check_waiting_now = asyncio.Event()
        self._committed = 0  # newest committed policy version, as last read
        self._load_failure: tuple[int, str] | None = None  # (version, reason) the follower gave up on
        self._finishes: list[_Finish] = []
        self._finish_wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._pulling = True
        self._recent_cancels: dict[str, float] = {}
        self._tasks: list[asyncio.Task] = []
        self._started_at = time.time()
        self._tok_window: tuple[float, int] = (time.monotonic(), 0)
        self._tokens_per_s = 0.0
        self._burst = False
        self._reclaim_now = asyncio.Event()
        self._engine_error: BaseException | None = None
        #: Hooks run before every pull (weight sync uses it to gate intake).
        self.intake_gate: asyncio.Event = asyncio.Event()
        self.intake_gate.set()
        self._paused_total = 0.0
        self._control_handlers: list[Callable[[Control, str], Any]] = []
        self._control_tasks: set[asyncio.Task] = set()
        self._leased = False
        self._registered = False  # the queue is in the registry of queues (refreshed each heartbeat)
        self._lost_read = False
        self._closed = False
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # entries recover_own took back
        self._parked: list[tuple[str, bytes, Job, int]] = []  # aborted for a weight update, to restart
        #: Weight-update figures shown in the registry (set by the weight follower).
        self.update_info: dict[str, Any] = {}

    # ==================================================================================
    # lifecycle
    # ==================================================================================
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
        self._burst = burst
        if install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        self.capacity = self._make_capacity()  # the engine is started now: its limits are known
        await self._connect()
        await self._setup_redis()
        self.state = "serving"
        self._tasks = [
            asyncio.create_task(self._finisher(), name="rollq-finish"),
            asyncio.create_task(self._heartbeat_loop(), name="rollq-heartbeat"),
            asyncio.create_task(self._reclaim_loop(), name="rollq-reclaim"),
            asyncio.create_task(self._control_loop(), name="rollq-control"),
            asyncio.create_task(self._version_wait_loop(), name="rollq-version-wait"),
        ]
        log.info("consumer %s serving queue %r with engine %s (%s)", self.id, self.queue, self.engine.name, self.engine.model)
        try:
            await self.recover_own(min_idle=0)  # a restart under the same id resumes its own leased jobs
            await self._pull_loop()
        finally:
            await self._shutdown()
        return self.exit_code

    def stop(self) -> None:
        """Stop pulling; finish running jobs within ``drain_timeout``; hand back the rest."""
        if not self._stopping.is_set():
            log.info("consumer %s stopping: no new jobs; draining %d running", self.id, len(self._running))
            self.state = "draining"
            self._stopping.set()
            self._room.set()

    async def _connect(self) -> None:
        self._client = connect(self.redis_settings)
        # The hot paths (reads, FINISH) use clients without socket timeouts, bounded by
        # deadline() instead (see rollq.connection: fewer event-loop turns per command).
        self._block_client = connect(self.redis_settings, socket_timeout=None, max_connections=4)
        self._finish_client = connect(self.redis_settings, socket_timeout=None, max_connections=4)
        # Reads take the reply as Redis sent it: redis-py's parsing (a dict per entry) cost
        # more than everything else the loop does with a job.
        raw_replies(self._block_client, "XREADGROUP")

    async def _setup_redis(self) -> None:
        backoff = self.settings.backoff_initial
        while True:
            try:
                await load_scripts(self._client)
                for stream in self._streams:
                    await self._ensure_group(stream)
                self._registered = await register_queue(self._client, self.queue)  # prunes stale names too
                await self._heartbeat_once()
                return
            except _RETRYABLE as e:
                log.warning("redis unavailable at start (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.backoff_max)

    async def _ensure_group(self, stream: str) -> None:
        try:
            await self._client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _shutdown(self) -> None:
        # Wait (bounded) for running jobs, then hand back what is left.
        deadline = time.monotonic() + (0 if self._engine_error else self.settings.drain_timeout)
        while (self._running or self._held) and time.monotonic() < deadline and not self._engine_error:
            await asyncio.sleep(0.02)
        if self._running or self._held or self._waiting:  # jobs waiting for a version are not waited for
            log.warning(
                "consumer %s handing back %d unfinished jobs", self.id, len(self._running) + len(self._held) + len(self._waiting)
            )
        for rid in list(self._running):
            self.engine.abort(rid)
        self._running.clear()
        self._by_job.clear()
        self._held.clear()
        self._waiting.clear()
        # Flush recorded outcomes (bounded wait even if Redis is down).
        self._finish_wakeup.set()
        flush_deadline = time.monotonic() + max(5.0, self.settings.drain_timeout / 5)
        while self._finishes and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)
        self._closed = True  # every background loop ends at its next turn, even if a cancel is lost
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # bounded: a task that swallows its cancellation must not hang shutdown
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            if stuck:
                log.warning("consumer %s: %d background task(s) ignored cancellation", self.id, len(stuck))
        self.state = "stopped"
        try:  # release the lease: peers reclaim our unfinished jobs at once
            await self._flush_stats()
            await self._client.delete(self.keys.heartbeat(self.id))
            await DROP_EMPTY(self._client, [self._own_stream], [])
            if not self._running and not self._held and not self._finishes:
                try:  # leave the group too, if we hold nothing there (our own stream is gone)
                    if not await self._client.xpending_range(self.keys.jobs, GROUP, min="-", max="+", count=1, consumername=self.id):
                        await self._client.xgroup_delconsumer(self.keys.jobs, GROUP, self.id)
                except ResponseError:
                    pass
            await self._client.hdel(self.keys.consumers, self.id)
            await self._client.publish(self.keys.control, control_message(Control.HANDBACK, self.id))
        except _RETRYABLE:
            pass
        for c in (self._client, self._block_client, self._finish_client):
            if c is not None:
                await c.aclose()
        log.info("consumer %s stopped (%d completed, %d failed)", self.id, self.counters.completed, self.counters.failed)

    # ==================================================================================
    # pull
    # ==================================================================================
    def free_slots(self) -> int:
        """Jobs the next read may take: the in-flight cap less what runs (or is held while
        intake is closed). Jobs waiting for a policy version run nothing and do not count,
        but at ``max_parked`` of them the replica stops pulling (0) until some start or fail."""
        if len(self._waiting) >= self.settings.max_parked:
            return 0
        return self.capacity.cap - len(self._running) - len(self._held)

    async def _pull_loop(self) -> None:
        s = self.settings
        backoff = s.backoff_initial
        block_ms = max(1, int(s.block * 1000))
        read_deadline = deadline(s.block + self.redis_settings.command_timeout, "a blocking read of the job streams")
        while not self._stopping.is_set():
            if not self.intake_gate.is_set():
                await self._wait_any(self.intake_gate.wait())
                continue
            free = self.free_slots()
            backlog = len(self._finishes)
            if free <= 0 or backlog > 4 * s.batch:
                self._room.clear()
                await self._wait_any(self._room.wait(), timeout=1.0)
                continue
            try:
                async with read_deadline:
                    resp = await self._block_client.xreadgroup(
                        GROUP, self.id, {k: ">" for k in self._streams}, count=min(free, s.batch),
                        block=50 if self._burst else block_ms,
                    )
                backoff = s.backoff_initial
            except ResponseError as e:
                if "NOGROUP" in str(e):  # Redis lost its data (no persistence) or keys were deleted
                    log.warning("consumer group missing; recreating it")
                    for stream in self._streams:
                        await self._ensure_group(stream)
                    continue
                raise
            except _RETRYABLE as e:
                self.counters.reconnects += 1
                log.warning("redis read failed (%s); reconnecting in %.2fs", e, backoff)
                await self._wait_any(self._stopping.wait(), timeout=backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, s.backoff_max)
                self._lost_read = True  # its reply may have been lost after Redis delivered
                continue
            if self._lost_read:
                self._lost_read = False
                try:
                    await self.recover_own()
                except _RETRYABLE:
                    self._lost_read = True
            if not resp:
                if self._burst and not self._running and not self._held and not self._waiting and not self._finishes:
                    if await self._nothing_left():
                        break
                continue
            # The block client returns XREADGROUP's reply unparsed (see _connect): a list of
            # [stream, [[entry id, [field, value, ...]], ...]] (a dict of streams on RESP3).
            seen = self._seen
            for stream, entries in resp.items() if isinstance(resp, dict) else resp:
                skey = self._names.get(stream) or _str(stream)
                for eid, fields in entries:
                    if seen and seen.pop((skey, eid), False) is None:
                        continue  # the late reply of a read whose entries recover_own took back
                    self._start_entry(skey, eid, _payload(fields), 1)
            if self._engine_error is not None:
                break
            if self._finishes:
                # Jobs that finished at once (a fast engine, rejected entries): let the
                # finisher send them before the next read, which may block.
                await asyncio.sleep(0)

    def _known_eids(self) -> set[bytes]:
        known = {r.eid for r in self._running.values()}
        known.update(h[1] for h in self._held)
        known.update(w.eid for w in self._waiting)
        known.update(f[1] for f in self._finishes)
        known.update(p[1] for p in self._parked)
        return known

    async def recover_own(self, min_idle: float | None = None) -> int:
        """Take back entries pending under this consumer that it is not running.

        They exist after a restart under the same id, or when a read reply was lost (a
        dropped connection, a Redis restart): Redis delivered them, we never saw them. Only
        entries idle for ``min_idle`` seconds are taken (default: long enough that a read
        whose reply is merely late has been handled), so nothing starts twice.
        """
        if min_idle is None:
            min_idle = 2 * self.settings.block + 2.0
        known = self._known_eids()
        taken = 0
        for stream in self._streams:
            try:
                rows = await self._client.xpending_range(
                    stream, GROUP, min="-", max="+", count=10_000, consumername=self.id, idle=int(min_idle * 1000)
                )
            except ResponseError:
                continue
            lost = [r["message_id"] for r in rows if r["message_id"] not in known]
            if not lost:
                continue
            # XCLAIM to ourselves re-checks the idle time atomically and returns the entries.
            claimed = await self._client.xclaim(stream, GROUP, self.id, int(min_idle * 1000), lost)
            counts = {r["message_id"]: int(r.get("times_delivered", 1)) for r in rows}
            for eid, fields in claimed:
                if eid in self._known_eids():
                    continue
                taken += 1
                self._seen[(stream, eid)] = None  # its read reply may still arrive: skip it then
                if len(self._seen) > 100_000:
                    self._seen.popitem(last=False)
                self._start_entry(stream, eid, _payload(fields), counts.get(eid, 1) + 1)
        if taken:
            log.warning("consumer %s recovered %d of its own pending jobs it was not running", self.id, taken)
        return taken

    async def _nothing_left(self) -> bool:
        """Burst mode: True when no stream holds undelivered or reclaimable entries for us."""
        try:
            for stream in self._streams:
                info = await self._client.xinfo_groups(stream)
                for g in info:
                    name = g.get("name") or g.get(b"name")
                    if name in (GROUP, GROUP.encode()):
                        lag = g.get("lag", g.get(b"lag"))
                        pending = g.get("pending", g.get(b"pending")) or 0
                        if (lag is None and (await self._client.xlen(stream))) or (lag or 0) > 0 or pending > 0:
                            return False
        except _RETRYABLE:
            return False
        return True

    async def _wait_any(self, aw: Any, timeout: float | None = None) -> None:
        """Wait for ``aw`` or for stop, whichever first."""
        t1 = asyncio.ensure_future(aw)
        t2 = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({t1, t2}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (t1, t2):
                if not t.done():
                    t.cancel()

    def _start_entry(self, stream: str, eid: bytes, payload: bytes | None, deliveries: int) -> None:
        """Decode, validate and start one stream entry (or finish it with an error).

        ``payload`` is the entry's ``d`` field (None if it has none: dead-lettered).
        """
        self.counters.pulled += 1
        if payload is None:
            self._fail(stream, eid, None, None, b"", DeadLettered, "stream entry has no 'd' field", deliveries, dlq=True)
            return
        try:
            job = decode_job(payload, self.settings.max_prompt_bytes)
        except Exception as e:  # noqa: BLE001 - whatever an entry does, it is dead-lettered, never fatal
            jid, reply = peek_id(payload)
            why = str(e) if isinstance(e, (ProtocolError, InvalidJob)) else f"undecodable entry: {type(e).__name__}"
            self._fail(stream, eid, jid, reply, payload, JobRejected, cut(why), deliveries, dlq=True)
            return
        if deliveries > self.settings.max_deliveries:
            self._fail(
                stream, eid, job.id, job.reply, payload, DeadLettered,
                f"delivered {deliveries} times (max_deliveries={self.settings.max_deliveries}); "
                "the replicas running it died or timed out each time",
                deliveries, dlq=True, job=job,
            )
            return
        if self._recent_cancels and job.id in self._recent_cancels:
            self._fail(stream, eid, job.id, job.reply, b"", JobCancelled, "cancelled before it started", deliveries, job=job)
            return
        if job.deadline is not None and time.time() > job.deadline:
            self._fail(stream, eid, job.id, job.reply, b"", JobExpired, "deadline passed while queued", deliveries, job=job)
            return
        if job.min_version is not None and job.min_version > self.version:
            self._wait_for_version(stream, eid, job, deliveries)
            return
        self._submit(stream, eid, job, deliveries)

    def _wait_for_version(self, stream: str, eid: bytes, job: Job, deliveries: int) -> None:
        now = time.monotonic()
        beyond = now if job.min_version > self._committed else None  # refined by the next check
        self._waiting.append(_Waiting(stream, eid, job, deliveries, now, beyond))
        if beyond is not None or self._load_failure is not None:
            self._check_waiting_now.set()

    def _submit(self, stream: str, eid: bytes, job: Job, deliveries: int) -> None:
        if not self.intake_gate.is_set():
            # A read that was in flight when intake closed (weight update): hold it until the
            # gate reopens, so it runs on the new version.
            self._held.append((stream, eid, job, deliveries))
            return
        rid = f"{job.id}@{eid.decode()}"
        self._running[rid] = _Running(job, stream, eid, deliveries, time.time(), self.version)
        self._by_job[job.id] = rid
        try:
            self.engine.submit(rid, job, self._on_done)
        except Exception as e:  # an engine must report through done; be safe anyway
            self._on_done(rid, e)

    def set_version(self, version: int, progress: SwapProgress | None = None) -> None:
        """The engine now serves ``version`` (weight sync calls this once the new weights are
        in). ``progress`` says how many tokens each running request had generated before the
        swap: every sample's result then records where each version began
        (:attr:`~rollq.protocol.Sample.versions`); without it those starts are unknown."""
        if version != self.version:
            for rid, run in self._running.items():
                if progress is None:
                    counts, complete = None, False
                else:
                    counts = progress.tokens.get(rid)
                    complete = progress.complete
                    if counts is None and complete:
                        counts = {}
                if run.swaps is None:
                    run.swaps = []
                run.swaps.append((version, counts, complete))
        self.version = version
        self.release_held()

    def running_count(self) -> int:
        return len(self._running)

    def abort_running(self) -> list[tuple[str, bytes, Job, int]]:
        """Abort every running request in the engine; the jobs stay leased to this replica.

        Returns them for :meth:`restart` (weight sync's ``abort`` policy).
        """
        out = []
        for rid, run in list(self._running.items()):
            self.engine.abort(rid)
            out.append((run.stream, run.eid, run.job, run.deliveries))
        self._running.clear()
        self._by_job.clear()
        self._parked = list(out)
        return out

    def restart(self, jobs: list[tuple[str, bytes, Job, int]]) -> None:
        """Run jobs returned by :meth:`abort_running` again, from scratch."""
        self._parked = []
        for stream, eid, job, deliveries in jobs:
            self._submit(stream, eid, job, deliveries)

    # -- the seam weight sync drives (rollq.weightsync.follower) ---------------------------
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
        self._paused_total += pause_s
        self.update_info = {
            "last_update_s": round(update_s, 4), "last_pause_s": round(pause_s, 4),
            "updates": self.update_info.get("updates", 0) + 1,
        }

    def release_held(self) -> None:
        """Start jobs held while intake was closed and those waiting for the policy version
        now loaded (the weight follower calls it after every update)."""
        if self._load_failure is not None and self.version >= self._load_failure[0]:
            self._load_failure = None
        held, self._held = self._held, []
        for stream, eid, job, deliveries in held:
            if job.min_version is not None and job.min_version > self.version:
                self._wait_for_version(stream, eid, job, deliveries)
            else:
                self._submit(stream, eid, job, deliveries)  # re-held while intake is closed
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for w in waiting:
                if w.job.min_version > self.version:
                    self._waiting.append(w)
                else:
                    self._submit(w.stream, w.eid, w.job, w.deliveries)
            if len(self._waiting) < len(waiting):
                self._room.set()

    # ==================================================================================
    # jobs waiting for a policy version
    # ==================================================================================
    def waiting_count(self) -> int:
        """Jobs waiting for a policy version newer than the loaded one."""
        return len(self._waiting)

    def version_failed(self, version: int, reason: str) -> None:
        """This replica cannot load committed policy ``version`` and will not retry it until a
        newer one is committed (the weight follower calls it). Jobs waiting for a version it
        would have served (``min_version <= version``) fail with
        :class:`~rollq.errors.VersionUnavailable` naming ``reason``, once Redis confirms that
        no newer version is committed; later versions are waited for as usual.

        >>> consumer.version_failed(7, "WeightMismatch: 1 shape mismatch ...")   # doctest: +SKIP
        """
        self._load_failure = (version, reason[:500])
        self._check_waiting_now.set()

    async def announce(self) -> None:
        """Write this replica's registry entry now, not at the next heartbeat (the weight
        follower calls it after an update, so ``wait_for_replicas`` sees it at once)."""
        if self._client is None or self._closed or self.state in ("starting", "stopped"):
            return
        try:
            await self._client.hset(self.keys.consumers, self.id, msgspec.msgpack.encode(self.info()))
        except _RETRYABLE as e:
            log.debug("registry update failed: %s", e)

    async def _version_wait_loop(self) -> None:
        while not self._closed:
            await self._wait_any(self._check_waiting_now.wait(), timeout=self.settings.heartbeat_interval)
            self._check_waiting_now.clear()
            if not self._waiting:
                continue
            try:
                await self._check_waiting()
            except _RETRYABLE as e:
                log.debug("version check failed: %s", e)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("version check error")

    async def _check_waiting(self) -> None:
        """Fail waiting jobs whose version cannot be reached (see the module docstring)."""
        v = await self._client.hget(self.keys.version, "v")
        committed = self._committed = int(v) if v is not None else 0
        s = self.settings
        now = time.monotonic()
        lf = self._load_failure
        keep: list[_Waiting] = []
        failed = 0
        last = ""
        for w in self._waiting:  # no await below: release_held cannot interleave
            m = w.job.min_version
            why = None
            if m <= self.version:
                keep.append(w)  # released by the next release_held
                continue
            if lf is not None and committed <= lf[0] and m <= lf[0]:
                why = (f"min_version {m}: replica {self.id} cannot load policy version {lf[0]}, the newest committed "
                       f"({lf[1]}); it serves version {self.version}")
            elif m > committed:
                if w.beyond_since is None:
                    w.beyond_since = now
                elif now - w.beyond_since > s.max_uncommitted_wait:
                    why = (f"min_version {m} is beyond the newest committed version {committed}: waited "
                           f"{now - w.beyond_since:.1f}s for it to be published (ConsumerSettings.max_uncommitted_wait="
                           f"{s.max_uncommitted_wait})")
            else:
                w.beyond_since = None
            if why is None and now - w.since > s.max_version_wait:
                why = (f"waiting for policy version {m} timed out after {now - w.since:.1f}s on replica {self.id} "
                       f"(serving {self.version}, newest committed {committed}; ConsumerSettings.max_version_wait="
                       f"{s.max_version_wait})")
            if why is None:
                keep.append(w)
                continue
            failed += 1
            last = why
            self._fail(w.stream, w.eid, w.job.id, w.job.reply, b"", VersionUnavailable, why, w.deliveries, job=w.job)
        if failed:
            self._waiting = keep
            log.warning("consumer %s: %d job(s) failed waiting for a policy version (last: %s)", self.id, failed, last[:300])
            self._room.set()

    # ==================================================================================
    # outcomes
    # ==================================================================================
    def _on_done(self, rid: str, out: EngineOutput | BaseException) -> None:
        run = self._running.pop(rid, None)
        if run is None:
            return  # aborted or already finished
        self._by_job.pop(run.job.id, None)
        job = run.job
        now = time.time()
        if isinstance(out, EngineOutput):
            if run.swaps:
                _mark_versions(out.samples, run.version_start, run.swaps)
            res = Result(
                id=job.id, samples=out.samples, prompt_tokens=out.prompt_tokens,
                version_start=run.version_start, version_end=self.version, replica=self.id,
                submitted=job.submitted, started=run.started, finished=now,
                deliveries=run.deliveries, meta=job.meta,
                prompt_ids=out.prompt_ids, prompt_lps=out.prompt_logprobs,
            )
            data = encode_result(res)
            if len(data) > self.settings.max_result_bytes:
                n_tok = sum(len(s.tokens) // 4 for s in out.samples)
                self._fail(run.stream, run.eid, job.id, job.reply, b"", ResultTooLarge,
                           f"the result ({len(out.samples)} samples, {n_tok} tokens) is {len(data)} bytes encoded, over "
                           f"ConsumerSettings.max_result_bytes={self.settings.max_result_bytes}; lower n, max_tokens or logprobs",
                           run.deliveries, job=job, started=run.started)
                self._room.set()
                return
            self._queue_finish(run.stream, run.eid, job.id if job.tracked else "", job.reply, data, b"", "completed", now - job.submitted, job.id)
            lag = self.version - run.version_start
            self.counters.lag[lag] = self.counters.lag.get(lag, 0) + 1
        elif isinstance(out, EngineDead):
            # Leave the job pending: a live replica will reclaim it.
            self._engine_error = out
            self.exit_code = 1
            log.error("engine died: %s; consumer %s stops pulling and exits", out, self.id)
            self.stop()
            return
        elif isinstance(out, InvalidJob):
            self._fail(run.stream, run.eid, job.id, job.reply, encode_job_safe(job), JobRejected, str(out), run.deliveries, dlq=True, job=job, started=run.started)
        else:
            self._fail(run.stream, run.eid, job.id, job.reply, b"", EngineFailed, f"{type(out).__name__}: {out}", run.deliveries, job=job, started=run.started)
        self._room.set()

    def _fail(
        self, stream: str, eid: bytes, job_id: str | None, reply: str | None, payload: bytes,
        err: type, message: str, deliveries: int, *, dlq: bool = False, job: Job | None = None,
        started: float = 0.0,
    ) -> None:
        """Finish an entry with an error result (if we know whom to tell) and/or a dead letter."""
        now = time.time()
        result = b""
        if job_id is not None and reply is not None:
            result = encode_result(
                Result(
                    id=job_id, error=ErrorInfo(type=err.__name__, message=message), replica=self.id,
                    version_start=self.version, version_end=self.version,
                    submitted=job.submitted if job else 0.0, started=started, finished=now,
                    deliveries=deliveries, meta=job.meta if job else None,
                )
            )
        dead = b""
        if dlq:
            keep = self.settings.dlq_payload_bytes
            dead = encode_dead_letter(
                DeadLetter(
                    job_id=job_id, reason=message, error_type=err.__name__, consumer=self.id,
                    deliveries=deliveries, at=now, source=stream, payload=payload[:keep], payload_bytes=len(payload),
                )
            )
            log.warning("dead-lettered entry %s of %s (job %s): %s", eid, stream, short(job_id), cut(message))
        tracked = job.tracked if job is not None else True  # unknown: forget the id if recorded
        self._queue_finish(stream, eid, (job_id or "") if tracked else "", reply, result, dead, "failed", None, job_id or "")

    def _queue_finish(self, stream: str, eid: bytes, job_id: str, reply: str | None, result: bytes, dead: bytes, counter: str,
                      latency_s: float | None, for_job: str = "") -> None:
        self._finishes.append(_Finish(stream, eid, job_id, reply, result, dead, counter,
                                      None if latency_s is None else latency_s * 1000, for_job))
        self._finish_wakeup.set()

    async def _finisher(self) -> None:
        """Write outcomes in batches: one FINISH call per flush, retried until Redis takes it."""
        s = self.settings
        backoff = s.backoff_initial
        while not self._closed:
            await self._finish_wakeup.wait()
            self._finish_wakeup.clear()
            while self._finishes:
                batch = self._next_batch()
                try:
                    flags = await asyncio.shield(self._finish_batch(batch))
                    backoff = s.backoff_initial
                except _RETRYABLE as e:
                    self.counters.reconnects += 1
                    log.warning("could not record %d results (%s); retrying in %.2fs", len(batch), e, backoff)
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, s.backoff_max)
                    continue
                except ResponseError as e:
                    # Redis refused the call (a value over its limits, out of memory): record
                    # the rows one at a time, so only the one it refuses fails.
                    n = len(batch)
                    batch, flags = await self._finish_one_by_one(batch, e)
                    del self._finishes[:n]
                    self._account(batch, flags)
                    self._room.set()
                    continue
                del self._finishes[: len(batch)]
                self._account(batch, flags)
                self._room.set()

    def _next_batch(self) -> list[_Finish]:
        n = batch_rows([len(f.result) + len(f.dead_letter) for f in self._finishes[: max(self.settings.batch, 256)]],
                       FINISH_BATCH_BYTES)
        return self._finishes[:n]

    async def _finish_one_by_one(self, batch: list[_Finish], error: Exception) -> tuple[list[_Finish], list[int]]:
        """Record ``batch`` row by row after Redis refused it whole. A row it refuses alone
        is recorded as an error result instead (``ResultTooLarge``, with Redis' reply), so
        no result waits behind it. Returns the rows as recorded and their FINISH flags."""
        rows, flags = [], []
        for f in batch:
            row, flag = await self._finish_row(f)
            rows.append(row)
            flags.append(flag)
        log.warning("recorded %d of %d results one by one after Redis refused them together: %s",
                    sum(flags), len(batch), cut(str(error)))
        return rows, flags

    async def _finish_row(self, f: _Finish) -> tuple[_Finish, int]:
        backoff = self.settings.backoff_initial
        for attempt in range(2):
            while True:
                try:
                    return f, (await asyncio.shield(self._finish_batch([f])))[0]
                except _RETRYABLE:
                    if self._closed:
                        return f, 0
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.settings.backoff_max)
                except ResponseError as e:
                    refused = e
                    break
            if attempt:
                log.error("Redis refused to finish entry %s even with an error result (%s); it stays pending",
                          f.eid, cut(str(refused)))
                return f, 0
            log.warning("Redis refused the result of job %s (%d bytes): %s", short(f.for_job), len(f.result),
                        cut(str(refused)))
            err = encode_result(Result(
                id=f.for_job, error=ErrorInfo(type=ResultTooLarge.__name__, message=cut(
                    f"Redis refused to store the result ({len(f.result)} bytes): {refused}")),
                replica=self.id, version_start=self.version, version_end=self.version, finished=time.time(),
            )) if f.result and f.for_job else b""
            f = f._replace(result=err, dead_letter=b"", counter="failed", latency_ms=None)
        return f, 0

    def _result_key(self, reply: str) -> str:
        k = self._result_keys.get(reply)
        if k is None:
            if len(self._result_keys) > 10_000:
                self._result_keys.clear()
            k = self._result_keys[reply] = self.keys.results(reply)
        return k

    async def _finish_batch(self, batch: list[_Finish]) -> list[int]:
        """One FINISH call for ``batch``: the rows in one msgpack argument, and the results of
        each producer packed here as the value of its one result entry (see finish.lua)."""
        keys = [self.keys.ids, self.keys.stats, self.keys.dlq]
        index: dict[str, int] = {}
        packs: dict[int, list[bytes]] = {}
        rows = []
        for stream, eid, job_id, reply, result, dead, counter, _, _ in batch:
            si = index.get(stream)
            if si is None:
                keys.append(stream)
                si = index[stream] = len(keys)
            ri = 0
            if reply and result:
                rk = self._result_key(reply)
                ri = index.get(rk)
                if ri is None:
                    keys.append(rk)
                    ri = index[rk] = len(keys)
                    packs[ri] = [result]
                else:
                    packs[ri].append(result)
            rows.append((si, eid, job_id, ri, "", dead, counter))
        # Redis' Lua cmsgpack reads str, not bin: pack bytes as str.
        args: list[Any] = [GROUP, int(self.settings.result_ttl * 1000), self.settings.dlq_maxlen, _pack(rows)]
        for ri, results in packs.items():
            args.append(ri)
            args.append(results[0] if len(results) == 1 else _pack(results))
        async with deadline(self.redis_settings.command_timeout, f"recording {len(batch)} results"):
            return await FINISH(self._finish_client, keys, args)

    def _account(self, batch: list[_Finish], flags: list[int]) -> None:
        c = self.counters
        buckets = c.latency_buckets
        completed = failed = dead = 0
        for f, ok in zip(batch, flags):
            if not ok:
                c.refused_duplicates += 1
                log.info("result for job %s refused: already finished elsewhere", f.job_id or f.eid)
                continue
            if f.counter == "completed":
                completed += 1
            else:
                failed += 1
            if f.dead_letter:
                dead += 1
            if f.latency_ms is not None:
                buckets[_bucket(f.latency_ms)] += 1
        if completed:
            c.completed += completed
        if failed:
            c.failed += failed
        if dead:
            c.dead_lettered += dead

    # ==================================================================================
    # heartbeat, cancellation, capacity
    # ==================================================================================
    def info(self) -> ReplicaInfo:
        st = self.engine.stats()
        return ReplicaInfo(
            id=self.id, host=socket.gethostname(), pid=os.getpid(), engine=self.engine.name,
            model=self.engine.model, device=self.engine.device, version=self.version,
            inflight=len(self._running), cap=self.capacity.cap, kv_usage=st.kv_usage,
            tokens_per_s=round(self._tokens_per_s, 1), completed=self.counters.completed,
            failed=self.counters.failed, started_at=self._started_at, heartbeat_at=time.time(),
            state=self.state, labels=dict(self.settings.labels), paused_s_total=round(self._paused_total, 4),
            tp_size=self.engine.tp_size,
            **self.update_info,
        )

    async def _heartbeat_once(self) -> None:
        st = self.engine.stats()
        t, n = self._tok_window
        now_m = time.monotonic()
        if now_m - t >= 1.0:
            self._tokens_per_s = (st.generated_tokens - n) / (now_m - t)
            self._tok_window = (now_m, st.generated_tokens)
        self.capacity.update(st, inflight=len(self._running))
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.id), b"1", px=int(self.settings.lease_ttl * 1000), get=True)
        pipe.hset(self.keys.consumers, self.id, msgspec.msgpack.encode(self.info()))
        if self._registered:  # refreshed here, so a long-lived queue stays listed
            add_registration(pipe, self.queue, prune=False)
        self._queue_stats(pipe)
        job_ids = list(self._by_job)
        if job_ids:
            # execute_command: redis-py's cluster pipeline refuses pipe.mget (the keys share one slot)
            pipe.execute_command("MGET", *[self.keys.cancel(j) for j in job_ids])
        res = await pipe.execute()
        if res[0] is None and self._leased:
            # Our lease lapsed (a stall or partition longer than lease_ttl): peers may have
            # taken over some of our jobs. Keep only those still ours.
            log.warning("consumer %s: lease had expired; checking which jobs are still ours", self.id)
            await self._drop_taken_over()
        self._leased = True
        if job_ids:
            for jid, mark in zip(job_ids, res[-1]):
                if mark is not None:
                    self._cancel_running(jid, "cancelled while running")
        now_s = time.time()
        for run in list(self._running.values()):  # a deadline passing mid-generation aborts it
            if run.job.deadline is not None and now_s > run.job.deadline:
                self._cancel_running(run.job.id, "deadline passed while running", JobExpired)
        now = time.time()
        self._recent_cancels = {k: v for k, v in self._recent_cancels.items() if now - v < 600}
        self._room.set()

    def _queue_stats(self, pipe: Any) -> None:
        buckets = self.counters.latency_buckets
        if any(buckets):
            for i, v in enumerate(buckets):
                if v:
                    pipe.hincrby(self.keys.latency, str(i), v)
            self.counters.latency_buckets = [0] * len(buckets)
        if self.counters.lag:
            for lag, n in self.counters.lag.items():
                pipe.hincrby(self.keys.lag, str(lag), n)
            self.counters.lag = {}

    async def _flush_stats(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        self._queue_stats(pipe)
        if len(pipe):
            await pipe.execute()

    async def _drop_taken_over(self) -> None:
        """Abort our copy of running jobs that are no longer pending under this consumer."""
        owned: set[bytes] = set()
        for stream in self._streams:
            try:
                rows = await self._client.xpending_range(
                    stream, GROUP, min="-", max="+", count=len(self._running) + 1000, consumername=self.id
                )
            except ResponseError:
                continue
            owned.update(r["message_id"] for r in rows)
        for rid, run in list(self._running.items()):
            if run.eid not in owned:
                del self._running[rid]
                self._by_job.pop(run.job.id, None)
                self.engine.abort(rid)
                log.info("job %s is owned by another replica now; aborted our copy", run.job.id)
        self._waiting = [w for w in self._waiting if w.eid in owned]

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                await self._heartbeat_once()
            except _RETRYABLE as e:
                log.debug("heartbeat failed: %s", e)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat error")

    def _cancel_running(self, job_id: str, why: str, error: type = JobCancelled) -> None:
        rid = self._by_job.get(job_id)
        if rid is None:
            return
        run = self._running.get(rid)
        if run is None:
            return
        self.engine.abort(rid)
        del self._running[rid]
        del self._by_job[job_id]
        self._fail(run.stream, run.eid, job_id, run.job.reply, b"", error, why, run.deliveries, job=run.job, started=run.started)
        self._room.set()

    async def _control_loop(self) -> None:
        """Pub/sub hints; the durable state is checked by heartbeat and reclaim anyway."""
        backoff = self.settings.backoff_initial
        while not self._closed:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self.keys.control)
                backoff = self.settings.backoff_initial
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    self._on_control(msg["data"].decode(errors="replace"))
            except asyncio.CancelledError:
                await pubsub.aclose()
                raise
            except _RETRYABLE as e:
                log.debug("control channel lost (%s)", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.backoff_max)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def _on_control(self, text: str) -> None:
        verb, arg = parse_control(text)
        if verb is None:
            return
        if verb is Control.CANCEL:
            self._recent_cancels[arg] = time.time()
            self._cancel_running(arg, "cancelled while running")
        elif verb is Control.HANDBACK and arg != self.id:
            self._reclaim_now.set()
        elif verb is Control.RESET_PREFIX_CACHE:  # a trainer asked (rollq.torchrl); every weight load resets it too
            task = asyncio.create_task(self.engine.reset_prefix_cache(), name="rollq-reset-prefix-cache")
            self._control_tasks.add(task)
            task.add_done_callback(self._control_tasks.discard)
        for cb in list(self._control_handlers):
            cb(verb, arg)

    def add_control_handler(self, cb: Callable[[Control, str], Any]) -> None:
        """Call ``cb(verb, arg)`` for every control message of a known verb (weight sync uses it)."""
        self._control_handlers.append(cb)

    # ==================================================================================
    # reclaim
    # ==================================================================================
    async def _reclaim_loop(self) -> None:
        while not self._closed:
            await self._wait_any(self._reclaim_now.wait(), timeout=self.settings.reclaim_interval * (0.75 + random.random() / 2))
            self._reclaim_now.clear()
            if self._stopping.is_set():
                await asyncio.sleep(0.05)
                continue
            try:
                await self.reclaim_once()
            except _RETRYABLE as e:
                log.debug("reclaim failed: %s", e)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reclaim error")

    async def reclaim_once(self) -> int:
        """Take over jobs of consumers whose lease expired. Returns how many were taken."""
        consumers = await self._client.xinfo_consumers(self.keys.jobs, GROUP)
        names = []
        for c in consumers:
            name = c.get("name") or c.get(b"name")
            name = name.decode() if isinstance(name, bytes) else name
            if name != self.id:
                names.append(name)
            elif int(c.get("pending") or 0) > len(self._known_eids()) and not self._stopping.is_set():
                # Redis holds more of our entries than we run: a read reply was lost.
                await self.recover_own()
        if not names:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for n in names:
            pipe.exists(self.keys.heartbeat(n))
        alive = await pipe.execute()
        taken = 0
        for name, is_alive in zip(names, alive):
            if is_alive:
                continue
            for stream in (self.keys.jobs, self.keys.replica_jobs(name)):
                # A dead replica's jobs are the oldest work in the queue: take them even past
                # our cap (they wait in the engine's own queue), at most one batch per turn.
                free = max(self.free_slots(), self.settings.batch)
                claimed, ids, counts = await RECLAIM(
                    self._client,
                    [stream, self.keys.heartbeat(name), self.keys.consumers, self.keys.replica_jobs(name)],
                    [GROUP, name, self.id, free, "1" if stream == self.keys.jobs else "0"],
                )
                deliveries = {i: int(c) for i, c in zip(ids, counts)}
                for entry in claimed:
                    if not entry:
                        continue
                    eid, flat = entry[0], entry[1]
                    taken += 1
                    self.counters.reclaimed += 1
                    self._start_entry(stream, eid, _payload(flat), deliveries.get(eid, 2))
                if claimed:
                    log.warning("reclaimed %d jobs of dead consumer %s from %s", len(claimed), name, stream)
        return taken


_pack = msgpack.Packer(use_bin_type=False).pack


#: Most bytes of results and dead letters in one FINISH call (Redis takes values up to
#: 512 MiB; smaller calls also keep one huge result from delaying many small ones).
FINISH_BATCH_BYTES = 64 << 20


def batch_rows(sizes: list[int], max_bytes: int) -> int:
    """How many of the next rows (of ``sizes`` bytes) one FINISH call takes: as many as fit in
    ``max_bytes``, and the first row always.

    >>> batch_rows([10, 10, 10], 25), batch_rows([100, 1], 25), batch_rows([], 25)
    (2, 1, 0)
    """
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if n and total > max_bytes:
            return n
    return len(sizes)


def _mark_versions(samples: list[Any], version_start: int, swaps: list[tuple[int, dict[int, int] | None, bool]]) -> None:
    """Fill each sample's ``versions`` (see :class:`~rollq.protocol.Sample`) from the swaps
    that happened while its job ran."""
    for j, sample in enumerate(samples):
        n = len(sample.tokens) // 4
        marks = [(version_start, 0)]
        for v, counts, complete in swaps:
            start = counts.get(j) if counts is not None else None
            if start is None:
                start = 0 if counts is not None and complete else UNKNOWN_START
            marks.append((v, min(start, n) if start != UNKNOWN_START else start))
        sample.versions = marks


def _str(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _payload(fields: Any) -> bytes | None:
    """The ``d`` field of a stream entry, given as a flat [field, value, ...] list (a raw
    reply) or as a dict; None when it has none."""
    if type(fields) is list:
        if len(fields) == 2 and fields[0] == _FIELD:
            return fields[1]
        for i in range(0, len(fields) - 1, 2):
            if fields[i] == _FIELD:
                return fields[i + 1]
        return None
    return fields.get(_FIELD) if fields else None


def encode_job_safe(job: Job) -> bytes:
    try:
        return encode_job(job)
    except Exception:
        return b""


def _bucket(ms: float) -> int:
    return bisect.bisect_left(LATENCY_BUCKETS_MS, ms)
