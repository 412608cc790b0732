"""Redis clients of rollq/connection.py under bursts: more commands at once than the pool
holds connections wait for one (first come, first served) instead of failing, on one
server and on a cluster; a wait that outlasts ``RedisSettings.pool_timeout`` fails with a
message that says so. Real redis-server and a real 3-master cluster."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import MaxConnectionsError

from rollq.connection import connect
from rollq.keys import QueueKeys
from rollq.pools import Turns
from rollq.serve.sessions import Sessions
from rollq.settings import RedisSettings
from tests.cluster_fixtures import redis_cluster  # noqa: F401


async def _burst(client, n: int) -> list:
    async def one(i: int):
        if i % 3 == 0:  # pipelines hold a connection for a round trip too
            pipe = client.pipeline(transaction=False)
            pipe.set(f"burst:{{b}}:{i}", i)
            pipe.get(f"burst:{{b}}:{i}")
            return (await pipe.execute())[1]
        await client.set(f"burst:{{b}}:{i}", i)
        return await client.get(f"burst:{{b}}:{i}")

    return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


async def test_a_burst_beyond_the_pool_waits_for_free_connections(redis_url):
    client = connect(RedisSettings.from_url(redis_url, max_connections=4))
    try:
        got = await _burst(client, 300)
        errors = [g for g in got if isinstance(g, BaseException)]
        assert not errors, f"{len(errors)} failed, e.g. {errors[0]!r}"
        assert got == [str(i).encode() for i in range(300)]
        pool = client.connection_pool
        assert pool.turns.waited > 0 and len(pool._in_use_connections) + len(pool._available_connections) <= 4
    finally:
        await client.aclose()


async def test_the_session_map_of_rollq_serve_takes_a_burst_of_requests(redis_url, queue):
    # Each HTTP request with a session key reads and writes the map: 500 at once on a pool of
    # 8 connections all get an answer.
    client = connect(RedisSettings.from_url(redis_url, max_connections=8))
    s = Sessions(client, QueueKeys(queue), margin=8, ttl=60)
    try:
        await asyncio.gather(*(s.served(f"s{i}", "a") for i in range(500)))
        picks = await asyncio.gather(*(s.pick(f"s{i}") for i in range(500)), return_exceptions=True)
        assert not [p for p in picks if isinstance(p, BaseException)]
        assert picks == [None] * 500  # no live replica in the free-slots hash: any replica
    finally:
        await client.aclose()


async def test_a_wait_longer_than_the_pool_timeout_fails_saying_so(redis_url):
    client = connect(RedisSettings.from_url(redis_url, max_connections=1, pool_timeout=0.3))
    try:
        held = await client.connection_pool.get_connection()  # the only connection, held
        t0 = time.monotonic()
        with pytest.raises(MaxConnectionsError, match=r"all 1 connections .* in use for 0.3 s"):
            await client.get("k")
        assert time.monotonic() - t0 >= 0.25
        await client.connection_pool.release(held)
        assert await client.get("k") is None  # the pool serves again
    finally:
        await client.aclose()


async def test_a_waiter_that_is_cancelled_passes_its_turn_on(redis_url, monkeypatch):
    monkeypatch.setattr(Turns, "POLL_S", 60.0)  # only a wake-up can hand the connection on
    client = connect(RedisSettings.from_url(redis_url, max_connections=1, pool_timeout=5))
    pool = client.connection_pool
    try:
        held = await pool.get_connection()
        first = asyncio.create_task(client.get("a"))
        second = asyncio.create_task(client.get("b"))
        await asyncio.sleep(0.05)
        assert len(pool.turns.waiting) == 2
        await pool.release(held)  # wakes the first waiter...
        first.cancel()  # ...which is cancelled before it runs: the second gets the connection
        assert await asyncio.wait_for(second, 2) is None
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not pool.turns.waiting
    finally:
        await client.aclose()


async def test_a_burst_beyond_the_node_pools_of_a_cluster_client_waits(redis_cluster):  # noqa: F811
    client = connect(RedisSettings.from_url(redis_cluster.url, max_connections=4))
    try:
        got = await _burst(client, 300)
        errors = [g for g in got if isinstance(g, BaseException)]
        assert not errors, f"{len(errors)} failed, e.g. {errors[0]!r}"
        assert got == [str(i).encode() for i in range(300)]
        assert client.gate.turns.waited > 0 and client.gate.in_use == 0
    finally:
        await client.aclose()


async def test_a_long_wait_is_logged_once_naming_the_pool(redis_url, monkeypatch, caplog):
    monkeypatch.setattr(Turns, "SLOW_S", 0.05)
    client = connect(RedisSettings.from_url(redis_url, max_connections=1))
    pool = client.connection_pool
    try:
        held = await pool.get_connection()
        waiting = [asyncio.create_task(client.get(f"k{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        with caplog.at_level("WARNING", logger="rollq.pools"):
            await pool.release(held)
            assert await asyncio.gather(*waiting) == [None] * 3
        slow = [r.getMessage() for r in caplog.records if r.name == "rollq.pools"]
        assert len(slow) == 1 and "1 connections" in slow[0] and "max_connections" in slow[0], slow
    finally:
        await client.aclose()
