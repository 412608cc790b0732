"""What the parts of one consumer share: who it is, its settings and connections, its counters,
and the events that pace its loops.

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

from ..connection import RETRYABLE, Client
from ..keys import GROUP, QueueKeys
from ..protocol import LATENCY_BUCKETS_MS
from ..settings import ConsumerSettings, RedisSettings
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
    keys: QueueKeys
    settings: ConsumerSettings
    redis_settings: RedisSettings
    engine: Engine
    counters: ConsumerCounters
    capacity: CapacityController
    #: This replica's targeted stream, then the queue's shared one: the streams it reads.
    streams: list[str]
    #: Loaded policy version.
    version: int = 0
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

    def __post_init__(self) -> None:
        self.intake.set()

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

    async def ensure_group(self, stream: str) -> None:
        """Create the consumer group of ``stream`` (and the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


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
