"""One replica: an engine, the consumer that feeds it and the weight follower that updates it.

Every place that runs a replica (``rollq consume``, the Ray actor, :class:`rollq.rl.Replicas`,
the fleet benchmark) builds it here, so the three parts start in one order and stop in the
reverse one:

1. the engine starts (unless the caller started it: ``own_engine=False``);
2. the follower loads the committed policy version (with ``weights``), so the consumer never
   pulls a job for a checkpoint the trainer has moved past;
3. the consumer pulls jobs.

A failure at any step stops what the earlier steps started, then raises.

>>> replica = Replica(EchoEngine(), "redis://127.0.0.1:6380/0", "grpo")   # doctest: +SKIP
>>> code = await replica.run(burst=True)    # start, serve until drained, stop  # doctest: +SKIP

or, serving in the background:

>>> async with Replica(engine, url, "grpo", weights=WeightSyncSettings(root="/dev/shm/w")) as r:  # doctest: +SKIP
...     await r.consumer.wait_ready()
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..settings import DEFAULT_QUEUE, ConsumerSettings, RedisSettings, WeightSyncSettings
from .engine import Engine
from .loop import Consumer

if TYPE_CHECKING:
    from ..weightsync.replica.follower import WeightFollower

log = logging.getLogger(__name__)


class Replica:
    """An engine, its :class:`~rollq.consumer.loop.Consumer` and (with ``weights``) its
    :class:`~rollq.weightsync.replica.follower.WeightFollower`, started and stopped together.

    ``own_engine``: the replica starts and stops ``engine``; False for an engine its caller
    started and stops (several queues served in turn by one engine, say).
    """

    def __init__(
        self,
        engine: Engine,
        url: str | RedisSettings | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        consumer_id: str | None = None,
        settings: ConsumerSettings | None = None,
        weights: WeightSyncSettings | None = None,
        own_engine: bool = True,
    ):
        self.engine = engine
        self.own_engine = own_engine
        self.consumer = Consumer(engine, url, queue, consumer_id=consumer_id, settings=settings)
        self.weights = weights
        self.follower: WeightFollower | None = None
        if weights is not None:
            from ..weightsync.replica.follower import WeightFollower

            self.follower = WeightFollower(self.consumer, self.weights)
        self._task: asyncio.Task[int] | None = None
        self._engine_started = False
        self._follower_started = False

    @property
    def id(self) -> str:
        return self.consumer.id

    async def _start_parts(self) -> None:
        """Engine, then the follower's first load; on a failure stop what started, then raise."""
        try:
            if self.own_engine:
                await self.engine.start()
                self._engine_started = True
            if self.follower is not None:
                await self.follower.start()
                self._follower_started = True
        except BaseException:
            await self._stop_parts()
            raise

    async def _stop_parts(self) -> None:
        """The follower, then the engine (each only if it started)."""
        try:
            if self._follower_started and self.follower is not None:
                self._follower_started = False
                await self.follower.stop()
        finally:
            if self._engine_started:
                self._engine_started = False
                await self.engine.stop()

    async def run(self, *, burst: bool = False, install_signal_handlers: bool = False) -> int:
        """Start, serve until the consumer stops (or, with ``burst``, drains), stop. Returns
        the consumer's exit code."""
        await self._start_parts()
        try:
            return await self.consumer.run(burst=burst, install_signal_handlers=install_signal_handlers)
        finally:
            await self._stop_parts()

    async def start(self) -> Replica:
        """Start the engine and the follower, then serve in a background task (:meth:`wait`)."""
        await self._start_parts()
        try:
            self._task = asyncio.create_task(self.consumer.run(), name=f"rollq-{self.id}")
        except BaseException:
            await self._stop_parts()
            raise
        return self

    async def wait(self) -> int:
        """Until the consumer started by :meth:`start` stops; its exit code."""
        assert self._task is not None, "Replica.wait before Replica.start"
        return await asyncio.shield(self._task)

    async def stop(self, timeout: float | None = None) -> bool:
        """Stop the consumer (it drains within its ``drain_timeout``), then the follower,
        then the engine (with ``own_engine``). ``timeout``: seconds to wait for the consumer
        before cancelling it. False: the consumer was cancelled after ``timeout``."""
        in_time = True
        try:
            if self._task is not None:
                self.consumer.stop()
                done, _ = await asyncio.wait([self._task], timeout=timeout)
                if not done:
                    in_time = False
                    log.warning("replica %s: consumer still draining after %ss; cancelling it", self.id, timeout)
                    self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
        finally:
            await self._stop_parts()
        return in_time

    async def __aenter__(self) -> Replica:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
