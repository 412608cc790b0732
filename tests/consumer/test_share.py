"""A burst is spread over the replicas with free slots, in proportion to them
(rollq/consumer/_share.py), with real redis-server and real consumers on echo engines.

Without the share, the replica whose blocked read Redis serves first takes the whole burst
(64 of 64 here), since one read takes up to ``min(free slots, batch)`` entries.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from rollq import Producer
from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.consumer._share import Fleet, entry, fair_share, fill_share
from rollq.settings import ConsumerSettings
from rollq.shards import home_shard
from tests.helpers import bounded, until

SLOTS = 64


def _settings(cap: int = SLOTS, shards: int = 1) -> ConsumerSettings:
    return ConsumerSettings(max_inflight=cap, initial_inflight=cap, adaptive=False, batch=64,
                            heartbeat_interval=0.2, block=1.0, shards=shards)


def _named(k: int, homes: list[int]) -> list[str]:
    """Replica names whose home shards (of ``k``) are ``homes``, in order."""
    names: list[str] = []
    for home in homes:
        names.append(next(n for i in range(100_000) if home_shard(n := f"b{i}", k) == home and n not in names))
    return names


async def _burst(redis_url: str, queue: str, caps: list[int], n: int, rounds: int = 1, *,
                 shards: int = 1, names: list[str] | None = None) -> list[Counter]:
    """Start one consumer per cap, wait until each sees its peers' free slots, submit
    ``rounds`` bursts of ``n`` jobs (each after the last completed); the replicas of each."""
    names = names or [f"b{i}" for i in range(len(caps))]
    consumers = [Consumer(EchoEngine(delay_per_token=0.02), redis_url, queue, consumer_id=name,
                          settings=_settings(cap, shards)) for name, cap in zip(names, caps)]
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    out = []
    try:
        if len(consumers) > 1:
            await until(lambda: all(c._ctx.peers_free > 0 for c in consumers), 10, "every replica sees its peers")
            await asyncio.sleep(1.2)  # a blocking read issued before that (block=1.0) has ended
        async with Producer(redis_url, queue) as p:  # it follows the queue's record of its shards
            for _ in range(rounds):
                hs = await p.submit_many([{"prompt": f"p{i}", "sampling": {"max_tokens": 4}} for i in range(n)])
                rs = await bounded(p.gather(hs, timeout=30), 40, "the burst's results")
                assert all(r.ok for r in rs)
                out.append(Counter(r.replica for r in rs))
                await until(lambda: all(c._ctx.peers_free > 0 for c in consumers) if len(consumers) > 1 else True,
                            10, "the replicas advertise free slots again")
    finally:
        for c in consumers:
            c.stop()
        await bounded(asyncio.gather(*tasks), 20, "the consumers to stop")
    return out


async def test_burst_of_64_spread_over_two_idle_replicas(redis_url, queue):
    for per_replica in await _burst(redis_url, queue, [SLOTS, SLOTS], 64, rounds=4):
        assert sum(per_replica.values()) == 64
        assert max(per_replica.values()) <= 0.6 * 64, per_replica


async def test_burst_on_a_sharded_queue_is_spread_over_each_shards_replicas(redis_url, queue):
    """Two shards, two replicas at home on each: a burst of 128 goes round robin, 64 to each
    shard, and each shard's replicas share it (the share counts the peers of the same home
    shard only; a replica reads the other shard only with room left after its home read)."""
    names = _named(2, [0, 0, 1, 1])
    for per_replica in await _burst(redis_url, queue, [SLOTS] * 4, 128, rounds=3, shards=2, names=names):
        assert sum(per_replica.values()) == 128
        assert max(per_replica.values()) <= 0.6 * 64, per_replica


async def test_burst_in_proportion_to_free_slots(redis_url, queue):
    # b0 has 96 free slots, b1 32: about 3/4 and 1/4 of 64.
    (per_replica,) = await _burst(redis_url, queue, [96, 32], 64)
    assert 40 <= per_replica["b0"] <= 56 and per_replica["b1"] >= 8, per_replica


async def test_lone_replica_takes_the_whole_burst(redis_url, queue):
    (per_replica,) = await _burst(redis_url, queue, [SLOTS], 64)
    assert per_replica == {"b0": 64}


async def test_a_peer_that_advertises_room_but_reads_nothing_starves_no_job(redis_url, queue, redis_client):
    """A peer's free slots are as of its last beat: one that stopped reading since (stuck,
    or gone before its entry expired) still counts, and the live replica takes its share,
    then the share of what is left, until nothing is left."""
    from rollq.keys import QueueKeys

    await redis_client.hset(QueueKeys(queue).free, "ghost", entry(10_000, home=0, cap=10_000))
    c = Consumer(EchoEngine(delay_per_token=0.01), redis_url, queue, consumer_id="b0", settings=_settings())
    task = asyncio.create_task(c.run())
    try:
        await until(lambda: c._ctx.peers_free >= 10_000, 10, "the replica sees the ghost's free slots")
        await asyncio.sleep(1.2)
        async with Producer(redis_url, queue) as p:
            hs = await p.submit_many([{"prompt": f"p{i}", "sampling": {"max_tokens": 4}} for i in range(64)])
            await redis_client.hset(QueueKeys(queue).free, "ghost", entry(10_000, home=0, cap=10_000))  # still "alive"
            rs = await bounded(p.gather(hs, timeout=10), 15, "every job of the burst")
        assert len(rs) == 64 and all(r.ok and r.replica == "b0" for r in rs)
    finally:
        c.stop()
        await bounded(task, 20, "the consumer to stop")


def test_fair_share():
    assert fair_share(64, mine=64, peers=64, most=64) == 32
    assert fair_share(64, mine=64, peers=0, most=64) == 64  # alone: everything at once
    assert fair_share(64, mine=96, peers=32, most=64) == 48
    assert fair_share(1000, mine=64, peers=64, most=64) == 64  # at most a read
    assert fair_share(1, mine=8, peers=1000, most=8) == 1  # at least one: no job is left
    assert fair_share(0, mine=8, peers=8, most=8) == 1
    assert fair_share(10, mine=0, peers=8, most=8) == 0  # no room, no read


def test_fill_share_fills_to_the_fleet_level():
    # Two idle replicas of 64, each woken with one entry of 64: 31 more each.
    assert fill_share(62, pending=2, mine_inflight=1, mine_cap=64, peers_cap=64, most=63) == 31
    # The peer took 33 before this one asked: this one takes the rest.
    assert fill_share(30, pending=34, mine_inflight=1, mine_cap=64, peers_cap=64, most=63) == 31  # 1 more than waits: harmless
    # Twice the cap, twice the part.
    assert fill_share(64, pending=0, mine_inflight=0, mine_cap=128, peers_cap=64, most=128) == 43
    # Already above its level: still one, so a lone reader drains the stream.
    assert fill_share(5, pending=40, mine_inflight=40, mine_cap=64, peers_cap=64, most=24) == 1


def test_fleet_counts_live_peers_of_the_home_shard_only():
    f = Fleet("me")
    table = {b"me": entry(100, 1000, 2, 100), b"a": entry(10, 1000, 2, 20), b"b": entry(5, 990, 2, 5),
             b"old": entry(50, 1, 2, 50), b"bad": b"x", b"text": b"5 1000 2", b"neg": entry(-3, 1000, 2),
             b"other": entry(70, 1000, 1, 70)}
    stale = f.update(table, now_ms=1500, ttl_ms=1000, home=2)
    assert (f.peers_free, f.peers_cap) == (15, 25)
    assert sorted(stale) == ["bad", "old", "text"]
    f.update(table, now_ms=1500, ttl_ms=1000, home=1)
    assert f.peers_free == 70


async def test_a_shard_whose_own_replica_advertises_room_but_reads_nothing_is_drained_by_others(redis_url, queue, redis_client):
    """Two shards, one live replica at home on shard 0 and a ghost advertising room at home on
    shard 1: the live replica leaves shard 1's jobs to the ghost only until that backlog has
    not shrunk for SHARE_PATIENCE, then takes them; every job finishes, once."""
    from rollq.keys import QueueKeys

    (name,) = _named(2, [0])
    ghost = next(n for i in range(100_000) if home_shard(n := f"g{i}", 2) == 1)
    c = Consumer(EchoEngine(delay_per_token=0.01), redis_url, queue, consumer_id=name, settings=_settings(shards=2))
    task = asyncio.create_task(c.run())
    try:
        await until(lambda: c.shards == 2, 10, "the replica to agree on two shards")
        await redis_client.hset(QueueKeys(queue).free, ghost, entry(10_000, home=1, cap=10_000))
        await until(lambda: c._ctx.free_by_home.get(1, 0) >= 10_000, 10, "the replica sees the ghost's free slots")
        async with Producer(redis_url, queue) as p:
            hs = await p.submit_many([{"prompt": f"p{i}", "sampling": {"max_tokens": 4}} for i in range(64)])
            await redis_client.hset(QueueKeys(queue).free, ghost, entry(10_000, home=1, cap=10_000))  # still "alive"
            rs = await bounded(p.gather(hs, timeout=15), 20, "every job of the burst")
        assert len(rs) == 64 and all(r.ok and r.replica == name for r in rs)
        assert len({r.id for r in rs}) == 64
    finally:
        c.stop()
        await bounded(task, 20, "the consumer to stop")
