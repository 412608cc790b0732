"""Redis connection pools that wait for a free connection instead of failing.

redis-py's asyncio pool (and each node's pool of its cluster client) refuses a command beyond
its ``max_connections`` with ``MaxConnectionsError`` at once. A burst of commands (hundreds of
HTTP clients of ``rollq serve`` reading the session map, or leaving and cancelling their jobs,
at once) then fails commands that a connection freed a millisecond later would have served.
Here such a command waits its turn, first come first served, for up to
``RedisSettings.pool_timeout`` seconds, and only then fails (``MaxConnectionsError``, saying
how long it waited). The pool still never opens more than ``max_connections`` connections.

Nothing changes while connections are free: a command takes one as redis-py would.

>>> turns = Turns(timeout=1.0)
>>> turns.waited, len(turns.waiting)
(0, 0)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError, MaxConnectionsError, RedisClusterException

T = TypeVar("T")
log = logging.getLogger(__name__)


def _exhausted(e: BaseException) -> bool:
    """Whether ``e`` is a pool's refusal (redis-py before 6 raised a plain ConnectionError)."""
    return isinstance(e, MaxConnectionsError) or (type(e) is ConnectionError and str(e) == "Too many connections")


class Turns:
    """Callers waiting for a connection, woken in the order they came.

    The owner tries first itself; while a connection is refused it calls ``wait(attempt,
    limit)``, which queues the caller behind those who came first and runs ``attempt``
    (raising ``MaxConnectionsError`` while no connection is free) once :meth:`wake` (a
    connection was released) comes to it. A caller also tries again after ``POLL_S`` seconds
    without a wake-up, so a release that did not call :meth:`wake` (a pool reset) delays it
    at most that.
    """

    POLL_S = 1.0
    #: A wait this long is logged (at most once a minute per pool), naming the pool's size.
    SLOW_S = 1.0

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.waiting: deque[asyncio.Future[bool]] = deque()
        #: Commands that had to wait for a connection.
        self.waited = 0
        self._logged_at = -1e9

    async def wait(self, attempt: Callable[[], Awaitable[T]], limit: int) -> T:
        self.waited += 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        front = False  # a caller woken whose connection another took goes first next time
        while True:
            left = self.POLL_S if deadline is None else min(self.POLL_S, deadline - loop.time())
            if left > 0:
                fut: asyncio.Future[bool] = loop.create_future()
                if front:
                    self.waiting.appendleft(fut)
                else:
                    self.waiting.append(fut)
                timer = loop.call_later(left, _poll, fut)
                try:
                    await fut
                except BaseException:
                    if fut.done() and not fut.cancelled() and fut.result():
                        self.wake()  # cancelled once woken: the wake-up goes to the next
                    raise
                finally:
                    timer.cancel()
                    if not fut.done() or fut.cancelled() or not fut.result():  # not taken off by a wake-up
                        with contextlib.suppress(ValueError):
                            self.waiting.remove(fut)
            try:
                got = await attempt()
            except ConnectionError as e:
                if not _exhausted(e):
                    raise
                if deadline is not None and loop.time() >= deadline:
                    raise MaxConnectionsError(
                        f"all {limit} connections of the Redis client's pool stayed in use for {self.timeout:g} s "
                        "(raise RedisSettings.max_connections or pool_timeout, or send fewer commands at once)"
                    ) from None
                front = True
                continue
            waited = loop.time() - t0
            if waited >= self.SLOW_S and loop.time() - self._logged_at >= 60:
                self._logged_at = loop.time()
                log.warning("a Redis command waited %.1f s for one of the client's %d connections (%d waiting now): "
                            "raise RedisSettings.max_connections, or send fewer commands at once", waited, limit,
                            len(self.waiting))
            return got

    def wake(self) -> None:
        """A connection was released: wake the caller that has waited longest."""
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(True)
                return


def _poll(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class WaitingConnectionPool(aredis.ConnectionPool):
    """redis-py's asyncio pool, whose commands wait for a connection while all
    ``max_connections`` are in use (for ``pool_timeout`` seconds; None: no limit)."""

    def __init__(self, *args: Any, pool_timeout: float | None = 30.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.turns = Turns(pool_timeout)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if not self.turns.waiting:
            try:
                return await super().get_connection(*args, **kwargs)
            except ConnectionError as e:
                if not _exhausted(e):
                    raise
        return await self.turns.wait(
            lambda: super(WaitingConnectionPool, self).get_connection(*args, **kwargs), self.max_connections
        )

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            self.turns.wake()


class Gate:
    """At most ``limit`` operations at once; the others wait their turn (see :class:`Turns`)."""

    def __init__(self, limit: int, timeout: float | None):
        self.limit = limit
        self.in_use = 0
        self.turns = Turns(timeout)

    async def _attempt(self) -> None:
        if self.in_use >= self.limit:
            raise MaxConnectionsError("Too many connections")
        self.in_use += 1

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if _HOLDING.get():  # a command run by one that holds a turn (a pipeline's redirection)
            yield
            return
        if self.turns.waiting or self.in_use >= self.limit:
            await self.turns.wait(self._attempt, self.limit)
        else:
            self.in_use += 1
        token = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(token)
            self.in_use -= 1
            self.turns.wake()


_HOLDING: contextvars.ContextVar[bool] = contextvars.ContextVar("rollq_cluster_turn", default=False)

#: Connections a cluster node's pool holds beyond ``max_connections``: commands and
#: pipelines pass the client's gate (``max_connections`` at once, one connection per node
#: each), while pub/sub takes its connections from the node's pool beside them.
NODE_HEADROOM = 16


class WaitingCluster(RedisCluster):
    """redis-py's asyncio cluster client, whose commands and pipelines wait their turn
    while ``max_connections`` of them are under way (each uses at most one connection of a
    node), instead of a node's pool refusing them."""

    def __init__(self, *args: Any, pool_timeout: float | None = 30.0, max_connections: int = 64, **kwargs: Any):
        kwargs["max_connections"] = max_connections + NODE_HEADROOM
        super().__init__(*args, **kwargs)
        self.gate = Gate(max_connections, pool_timeout)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.gate.turn():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py makes its own


class _WaitingPipeline(ClusterPipeline):
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        gate: Gate = self.cluster_client.gate  # type: ignore[attr-defined]
        async with gate.turn():
            return await super().execute(*args, **kwargs)
