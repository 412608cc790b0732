"""A replica's targeted stream (``rollq:{q}:r:<id>``) deleted under a blocked read.

A peer that takes a live replica for dead (its lease lapsed in a stall) runs RECLAIM, which
deletes that replica's targeted stream once it is empty. Redis then ends the replica's
blocked ``XREADGROUP`` with ``UNBLOCKED the stream key no longer exists``; the replica must
re-create its stream and group and read on, losing and doubling nothing.

Each test has a redis-server of its own, so that the one blocked ``XREADGROUP`` in
``CLIENT LIST`` is the consumer's.
"""

from __future__ import annotations

import asyncio

from rollq.connection import RECLAIM, connect, load_scripts
from rollq.keys import GROUP, QueueKeys
from tests.helpers import until

ONE = {"sampling": {"max_tokens": 1}}


async def blocked_reads(client) -> int:
    """Clients blocked in XREADGROUP now."""
    return sum(1 for c in await client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""))


async def last_id(client, stream: str) -> bytes | None:
    """The last entry id ``stream`` generated (``0-0`` once re-created), None if it is gone."""
    try:
        return (await client.xinfo_stream(stream))["last-generated-id"]
    except Exception as e:  # no such key
        if "no such key" in str(e).lower():
            return None
        raise


async def serve_after(task: asyncio.Task, p, consumer_id: str) -> None:
    """Targeted and shared jobs submitted now each complete exactly once on the consumer,
    which is still running."""
    results_before = p.counters["results"]
    targeted = [await p.submit(f"t{i}", replica=consumer_id, **ONE) for i in range(3)]
    shared = await p.submit_many([{"prompt": f"s{i}", **ONE} for i in range(5)])

    async def results() -> list:
        return await p.gather(targeted + shared, timeout=20)

    waiter = asyncio.ensure_future(results())
    done, _ = await asyncio.wait({waiter, task}, timeout=25, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        e = task.exception()
        raise AssertionError(f"Consumer.run() ended while serving: {type(e).__name__}: {e}")
    assert waiter in done, "the jobs submitted after the deletion did not complete"
    rs = waiter.result()
    assert all(r.ok and r.replica == consumer_id and r.deliveries == 1 for r in rs)
    assert sorted(r.id for r in rs) == sorted(h.id for h in targeted + shared)
    assert [x async for x in p.results(timeout=0.5)] == [], "a job returned a second result"
    assert p.counters["results"] == results_before + len(rs)
    assert not task.done()


async def test_targeted_stream_deleted_under_a_blocked_read(fresh_redis, queue, make_producer, make_consumer):
    k = QueueKeys(queue)
    client = connect(fresh_redis.url)
    try:
        c = make_consumer(queue, consumer_id="a", url=fresh_redis.url, block=3.0)
        task = make_consumer.start(c)
        p = await make_producer(queue, url=fresh_redis.url)
        before = await p.submit_many([{"prompt": f"b{i}", **ONE} for i in range(3)])
        assert all(r.ok for r in await p.gather(before, timeout=10))
        await until(lambda: blocked_reads(client), 10, "the consumer to block in XREADGROUP")
        assert await client.delete(k.replica_jobs("a")) == 1
        await serve_after(task, p, "a")
        assert await client.exists(k.replica_jobs("a")), "the targeted stream was not re-created"
        assert c.counters.completed == 3 + 8
    finally:
        await client.aclose()


async def test_peer_reclaim_of_a_live_replica_under_a_blocked_read(fresh_redis, queue, make_producer, make_consumer):
    """The path of the fleet simulation: a peer runs RECLAIM on a replica whose lease key is
    missing (a stall), which forgets it and deletes its empty targeted stream while the
    replica is blocked on it."""
    k = QueueKeys(queue)
    client = connect(fresh_redis.url)
    try:
        # Heartbeats far apart: the lease key the test deletes stays deleted while the peer looks.
        c = make_consumer(queue, consumer_id="a", url=fresh_redis.url, block=3.0, heartbeat_interval=60, lease_ttl=120)
        task = make_consumer.start(c)
        p = await make_producer(queue, url=fresh_redis.url)
        before = await p.submit_many([{"prompt": f"b{i}", **ONE} for i in range(2)] + [{"prompt": "b", "replica": "a", **ONE}])
        assert all(r.ok for r in await p.gather(before, timeout=10))
        assert await last_id(client, k.replica_jobs("a")) not in (None, b"0-0")
        await until(lambda: blocked_reads(client), 10, "the consumer to block in XREADGROUP")
        await client.delete(k.heartbeat("a"))
        await load_scripts(client)
        for stream, forget in ((k.jobs, "1"), (k.replica_jobs("a"), "0")):  # as Reclaimer._take_over
            claimed, _, _ = await RECLAIM(
                client, [stream, k.heartbeat("a"), k.consumers, k.replica_jobs("a")], [GROUP, "a", "peer", 64, forget]
            )
            assert claimed == []
        # RECLAIM deleted the targeted stream (the consumer may have re-created it already)
        assert await last_id(client, k.replica_jobs("a")) in (None, b"0-0")
        await serve_after(task, p, "a")
        assert c.counters.completed == 3 + 8 and c.counters.reclaimed == 0
    finally:
        await client.aclose()
