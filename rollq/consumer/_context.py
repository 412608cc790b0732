"""What the parts of one consumer share: who it is, its settings and connections, its counters,
the shards it serves, and the events that pace its loops.

:class:`~rollq.consumer.loop.Consumer` builds one :class:`ReplicaContext` and hands it to
each part (puller, finisher, lease, reclaimer, control listener, version wait); the parts
hold no reference to the consumer itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from redis.exceptions import ResponseError

from ..connection import RETRYABLE, Client, text
from ..keys import GROUP, QueueKeys
from ..protocol import LATENCY_BUCKETS_MS
from ..settings import ConsumerSettings, RedisSettings
from ..shards import ShardMap
from .capacity import CapacityController
from .engine import Engine

log = logging.getLogger(__name__)


@dataclass
class ConsumerCounters:
    """What one consumer did since it started (``latency_buckets`` and ``lag`` since its last
    heartbeat, which adds them to the queue's histograms)."""

    pulled: int = 0
    completed: int = 0
    failed: int = 0
    dead_lettered: int = 0
    refused_duplicates: int = 0
    reclaimed: int = 0
    reconnects: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_MS) + 1))
    lag: dict[int, int] = field(default_factory=dict)


@dataclass(eq=False)
class ReplicaContext:
    """State every part of one consumer reads; the consumer owns and updates it."""

    id: str
    queue: str
    #: The queue's own keys (shard 0): queue-wide things (versions, control, registry,
    #: histograms, weight sync) live there.
    keys: QueueKeys
    settings: ConsumerSettings
    redis_settings: RedisSettings
    engine: Engine
    counters: ConsumerCounters
    capacity: CapacityController
    #: The queue's shards (index = shard number; one for an unsharded queue): their keys,
    #: and the shard of a stream this replica read (``shards.of_key(stream)``).
    shards: ShardMap = field(init=False)
    #: This replica's home shard: where it blocks and where jobs targeted at it go.
    home: QueueKeys | None = None
    #: What this replica reads: the home shard's targeted and shared streams (one blocking
    #: read; one slot on Redis Cluster).
    streams: list[str] = field(default_factory=list)
    #: The streams read from each other shard (shard number -> its shared stream, plus this
    #: replica's targeted stream there if that shard was its home before the queue grew).
    other_reads: dict[int, list[str]] = field(default_factory=dict)
    #: Loaded policy version.
    version: int = 0
    #: Free slots of the other live replicas of the home shard, as of their last heartbeat (read
    #: every beat, see rollq/consumer/_share.py): the puller reads its share of a burst.
    peers_free: int = 0
    #: ... and their in-flight caps.
    peers_cap: int = 0
    #: Free slots of the other live replicas by home shard (the reads of other shards).
    free_by_home: dict[int, int] = field(default_factory=dict)
    #: Commands (with socket timeouts), blocking reads and FINISH calls (both without socket
    #: timeouts, bounded by ``connection.deadline``); set when the consumer connects.
    redis: Client | None = None
    block_redis: Client | None = None
    finish_redis: Client | None = None
    #: Set while jobs may start; weight sync clears it around an update.
    intake: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when a slot may have freed: wakes the puller when it waits for room.
    room: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by ``Consumer.stop()``: no more pulls.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    #: Every background loop ends at its next turn (set at the end of shutdown).
    closed: bool = False
    #: Burst mode: the puller returns once the queue is drained.
    burst: bool = False
    #: The engine died (an ``EngineDead`` outcome); the consumer stops and exits 1.
    engine_error: BaseException | None = None
    #: What the registry entry shows: ``starting | serving | paused | draining | stopped``,
    #: when the consumer was built (unix seconds), and its weight updates (paused seconds in
    #: all; ``last_update_s``, ``last_pause_s`` and ``updates`` of ReplicaInfo).
    state: str = "starting"
    started_at: float = field(default_factory=time.time)
    paused_s_total: float = 0.0
    update_info: dict[str, Any] = field(default_factory=dict)
    #: dtypes of the current policy version that the engine converts to the one it serves.
    converted_from: list[str] = field(default_factory=list)
    #: Keys found holding another type than rollq writes there (a stray ``SET``): key -> the
    #: type found. Each is logged once as an error, and again once it is usable.
    bad_keys: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.intake.set()
        self.set_shards(1)

    # -- shards ------------------------------------------------------------------------------
    def set_shards(self, k: int) -> None:
        """Serve ``k`` shards (more than before, when the queue's record grew): the home shard
        moves to ``home_shard(id, k)``; a former home's targeted stream is still read, so
        jobs targeted here before the change are served."""
        former = self.home
        self.shards = ShardMap(self.keys, k)
        self.home = self.shards.home(self.id)
        self.streams = [self.home.replica_jobs(self.id), self.home.jobs]
        self.other_reads = {i: [s.jobs] for i, s in enumerate(self.shards) if s is not self.home}
        if former is not None and former.shard_index != self.home.shard_index:
            self.other_reads[former.shard_index].insert(0, former.replica_jobs(self.id))

    def read_streams(self) -> list[str]:
        """Every stream this replica reads (home first)."""
        out = list(self.streams)
        for streams in self.other_reads.values():
            out.extend(streams)
        return out

    def stop(self, running: int) -> None:
        """Stop pulling (``running``: how many jobs run, for the log line); see ``Consumer.stop``."""
        if not self.stopping.is_set():
            log.info("consumer %s stopping: no new jobs; draining %d running", self.id, running)
            self.state = "draining"
            self.stopping.set()
            self.room.set()

    async def wait_any(self, aw: Any, timeout: float | None = None) -> None:
        """Wait for ``aw`` or for stop, whichever first (at most ``timeout``)."""
        t1 = asyncio.ensure_future(aw)
        t2 = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({t1, t2}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (t1, t2):
                if not t.done():
                    t.cancel()

    async def take_up_shards(self, k: int) -> None:
        """The queue's record says ``k`` shards, more than this replica serves: renew the lease
        in the new shards (so their reclaimers see this replica alive once it reads there),
        create the groups it will read, then read them."""
        have = len(self.shards)
        if k <= have:
            return
        layout = ShardMap(self.keys, k)
        new = layout[have:]
        for s in new:
            await self.redis.set(s.heartbeat(self.id), b"1", px=int(self.settings.lease_ttl * 1000))
        home = layout.home(self.id)
        for stream in (home.replica_jobs(self.id), *(s.jobs for s in new)):
            await self.ensure_group(stream)
        log.info("consumer %s: queue %r now has %d shards; serving them all (home shard %d)",
                 self.id, self.queue, k, home.shard_index)
        self.set_shards(k)

    async def ensure_group(self, stream: str) -> bool:
        """Create the consumer group of ``stream`` (and the stream) unless it exists.

        Returns False when the key holds something else than a stream (logged once, see
        :meth:`key_is_bad`): the puller skips it and tries again later."""
        try:
            await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if wrong_type(e):
                await self.stream_is_bad(stream)
                return False
            if "BUSYGROUP" not in str(e):
                raise
        self.key_is_good(stream)
        return True

    async def stream_is_bad(self, key: str) -> str | None:
        """A command on job stream ``key`` was refused with WRONGTYPE: read what the key holds
        (``TYPE``) and log an error naming it, once until it is usable again. Returns the type
        found (None if the key holds a stream again, or nothing: worth reading at once)."""
        found = text(await self.redis.type(key))
        if found in ("stream", "none"):
            return None
        if self.bad_keys.get(key) != found:
            log.error("consumer %s: key %r holds a %s, not a job stream: skipping it (the other streams "
                      "and shards are served; it is tried again with backoff until it is repaired)",
                      self.id, key, found)
        self.bad_keys[key] = found
        return found

    def key_is_good(self, key: str) -> None:
        """``key`` was used without error: if it was bad, say it is usable again."""
        if self.bad_keys.pop(key, None) is not None:
            log.info("consumer %s: key %r is usable again", self.id, key)


def wrong_type(e: ResponseError) -> bool:
    """Redis refused a command because a key holds another type (``WRONGTYPE``)."""
    return str(e).startswith("WRONGTYPE")


async def guarded(log: logging.Logger, what: str, step: Callable[[], Awaitable[Any]]) -> None:
    """Run one turn of a background loop: a Redis outage is logged at debug level (the next
    turn retries), any other error with its traceback; neither ends the loop."""
    try:
        await step()
    except RETRYABLE as e:
        log.debug("%s failed: %s", what, e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s error", what)
