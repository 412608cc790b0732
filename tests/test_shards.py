"""Shard routing and the queue's shard-count record (rollq/shards.py, QueueKeys.shard)."""

from __future__ import annotations

import collections
import uuid

import pytest
import redis.asyncio as aioredis

from rollq.errors import ShardCountMismatch
from rollq.keys import QueueKeys
from rollq.shards import SHARDS_FIELD, declare_shards, home_shard, read_shards, shard_of_id, split_budget


def test_shard_keys_have_their_own_tag_and_queue_wide_keys_stay_in_shard_0():
    k = QueueKeys("grpo")
    assert k.shard(0) is k and k.base is k
    s3 = k.shard(3)
    assert s3.jobs == "rollq:{grpo~3}:jobs" and s3.results("p") == "rollq:{grpo~3}:res:p"
    assert s3.base.version == k.version == "rollq:{grpo}:version"
    assert [s.tag for s in k.shards(3)] == ["rollq:{grpo}", "rollq:{grpo~1}", "rollq:{grpo~2}"]
    # A shard's tag is never a queue's: "~" is not allowed in queue names.
    with pytest.raises(ValueError):
        QueueKeys("grpo~1")
    with pytest.raises(ValueError):
        QueueKeys("grpo", 256)


def test_routing_is_stable_and_spreads_ids_and_replicas():
    ids = [f"job-{i}" for i in range(4000)]
    counts = collections.Counter(shard_of_id(i, 4) for i in ids)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 800
    assert [shard_of_id(i, 4) for i in ids[:50]] == [shard_of_id(i, 4) for i in ids[:50]]
    assert all(shard_of_id(i, 1) == 0 and home_shard(i, 1) == 0 for i in ids[:50])
    homes = collections.Counter(home_shard(f"replica-{i}", 4) for i in range(400))
    assert set(homes) == {0, 1, 2, 3}


@pytest.mark.parametrize("total,k", [(8, 4), (10, 4), (7, 3), (1, 1), (100, 7)])
def test_split_budget_adds_up_and_is_even(total, k):
    parts = split_budget(total, k)
    assert sum(parts) == total and len(parts) == k and max(parts) - min(parts) <= 1


async def test_the_first_named_count_is_recorded_and_another_is_refused(redis_url):
    r = aioredis.from_url(redis_url)
    keys = QueueKeys("sharded-record")
    try:
        assert await declare_shards(r, keys, None) == 1  # nothing recorded: one shard, nothing written
        assert await r.hget(keys.config, SHARDS_FIELD) is None
        assert await declare_shards(r, keys, 4) == 4
        assert await declare_shards(r, keys, None) == 4 and await read_shards(r, keys) == 4
        assert await declare_shards(r, keys.shard(2), 4) == 4  # any shard's keys find the record
        with pytest.raises(ShardCountMismatch, match="has 4 shard"):
            await declare_shards(r, keys, 2)
        with pytest.raises(ValueError):
            await declare_shards(r, keys, 0)
        await r.hset(keys.config, SHARDS_FIELD, "many")
        with pytest.raises(ShardCountMismatch, match="invalid shard count"):
            await read_shards(r, keys)
    finally:
        await r.delete(keys.config)
        await r.aclose()


async def test_a_queue_that_ran_unsharded_carries_its_version_and_bound_over(redis_url):
    """Sharding a queue that has run (version 3 committed, a staleness bound of batch 10 with
    35 jobs admitted in its one shard): every shard mirrors version 3, the bound is split, and
    what shard 0 admitted beyond its part is charged to the others, so the queue still admits
    at most (max_lag + version + 1) * batch in all."""
    from rollq.connection import load_scripts
    from rollq.weightsync.versions import VersionRecord, commit_version

    r = aioredis.from_url(redis_url)
    keys = QueueKeys(f"grow-{uuid.uuid4().hex[:8]}")
    try:
        await load_scripts(r)
        await commit_version(r, keys, VersionRecord(version=3, transport="memmap", checksum="0", num_tensors=0, nbytes=0))
        await r.hset(keys.config, mapping={"max_lag": 0, "batch": 10})  # limit (0 + 3 + 1) * 10 = 40
        await r.hset(keys.admission, "admitted", 35)
        with pytest.raises(ValueError, match="batch=10, fewer jobs than 16 shards"):
            await declare_shards(r, keys, 16)
        assert await r.hget(keys.config, SHARDS_FIELD) is None  # refused before recording

        assert await declare_shards(r, keys, 4) == 4
        shards = keys.shards(4)
        assert [await r.hget(s.version, "v") for s in shards] == [b"3"] * 4
        assert [await r.hmget(s.config, "max_lag", "batch") for s in shards] == [[b"0", str(b).encode()] for b in (3, 3, 2, 2)]
        # Limits (0 + 3 + 1) * part = 12, 12, 8, 8; shard 0 holds 35: 23 over, charged 12 then 8 then 3.
        admitted = [int(await r.hget(s.admission, "admitted") or 0) for s in shards]
        assert admitted == [35, 12, 8, 3]
        room = sum(max(0, lim - a) for lim, a in zip((12, 12, 8, 8), admitted))
        assert 35 + room == 40  # the bound the queue had

        assert await declare_shards(r, keys, 4) == 4  # a second declaration carries nothing again
        assert [int(await r.hget(s.admission, "admitted") or 0) for s in shards] == admitted
    finally:
        for s in keys.shards(4):
            await r.delete(s.config, s.version, s.admission, s.versions_log)
        await r.aclose()


def test_shard_map_finds_the_shard_of_every_key_name_of_the_queue():
    from rollq.shards import ShardMap

    m = ShardMap(QueueKeys("grpo", 3), 4)  # built from any shard's keys: the queue's layout
    assert m.base == QueueKeys("grpo") and m[0] is m.base
    assert [s.shard_index for s in m] == [0, 1, 2, 3] and len(m) == 4 and m[1:3] == [m[1], m[2]]
    for s in m:
        for key in (s.jobs, s.replica_jobs("r1"), s.results("p1"), s.submit_calls("p1"), s.cancel("j:1}x"), s.config):
            assert m.of_key(key) is s
    # a key of another queue, of a shard beyond the count, or of no queue at all
    for key in (QueueKeys("grpo2").jobs, QueueKeys("grpo", 4).jobs, "rollq:queues", "x}"):
        with pytest.raises(KeyError, match="no shard of queue 'grpo'"):
            m.of_key(key)
    assert m.of_id("job-7") is m[shard_of_id("job-7", 4)] and m.home("r1") is m[home_shard("r1", 4)]
    assert m.split(10) == split_budget(10, 4)
    with pytest.raises(ValueError, match="invalid shard count"):
        ShardMap(QueueKeys("grpo"), 0)


def test_producer_and_replica_share_one_layout(redis_url, queue):
    """Both sides route and resolve through ShardMap: the stream a producer routes a job to
    is the one whose shard a replica finds for it."""
    from rollq import Producer
    from rollq.consumer.engine import EchoEngine
    from rollq.consumer.loop import Consumer
    from rollq.shards import ShardMap

    p = Producer(redis_url, queue)
    p._set_shards(4)
    ctx = Consumer(EchoEngine(), redis_url, queue=queue, consumer_id="r1")._ctx  # not connected
    ctx.set_shards(4)
    assert isinstance(p._map, ShardMap) and isinstance(ctx.shards, ShardMap)
    assert list(p._map) == list(ctx.shards)
    # a stream of another replica's home (met in a reclaim) resolves by its name alone
    other = ctx.shards.home("r2").replica_jobs("r2")
    assert ctx.shards.of_key(other) == p._map.home("r2")
    assert ctx.home == p._map.home("r1") and ctx.streams[0] == ctx.home.replica_jobs("r1")
