"""The producer on a sharded queue (rollq/shards.py): routing of every kind of job, results
from every shard, the staleness bound split over the shards with the version mirrored into
each, cancellation in a job's shard, the chunked (cluster) path with lost replies, and the
shard count agreed at connect.

The replica side is played by the test where it must be exact: it reads the shard streams
itself and writes results into the producer's result stream of each shard, as the finisher
does (``rollq/lua/finish.lua``: field ``d``, one encoded Result).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rollq.connection import connect
from rollq.errors import ShardCountMismatch, StalenessBound, SubmitInterrupted
from rollq.keys import QueueKeys
from rollq.producer.client import Producer
from rollq.protocol import Result, decode_job, encode_result
from rollq.settings import ProducerSettings, RedisSettings
from rollq.shards import home_shard, shard_of_id, split_budget
from rollq.testing.chaos import CutProxy
from rollq.weightsync.versions import VersionRecord, commit_version
from tests.helpers import bounded, collect, until

SAMPLING = {"max_tokens": 1}


def ids_with_shard(shard: int, k: int, n: int, prefix: str = "job") -> list[str]:
    """``n`` caller-chosen ids that ``shard_of_id`` puts in ``shard`` (of ``k``)."""
    out = [f"{prefix}-{i}" for i in range(10_000) if shard_of_id(f"{prefix}-{i}", k) == shard]
    assert len(out) >= n
    return out[:n]


async def stream_ids(client, stream: str) -> list[str]:
    """Job ids of a jobs stream, in order (bounded: test streams hold a few thousand)."""
    return [decode_job(f[b"d"]).id for _, f in await client.xrange(stream, count=100_000)]


async def shard_ids(client, keys: QueueKeys, k: int) -> list[list[str]]:
    return [await stream_ids(client, s.jobs) for s in keys.shards(k)]


async def answer_all(client, keys: QueueKeys, k: int, producer_id: str) -> int:
    """Play the replicas: every queued job of every shard gets a result in the producer's
    result stream of the job's shard (and leaves its stream). Returns how many."""
    n = 0
    for s in keys.shards(k):
        for eid, f in await client.xrange(s.jobs, count=100_000):
            job = decode_job(f[b"d"])
            await client.xadd(s.results(producer_id), {"d": encode_result(Result(id=job.id, replica=f"shard{s.shard_index}"))})
            await client.xdel(s.jobs, eid)
            n += 1
    return n


# -- 1. routing ----------------------------------------------------------------------------
async def test_routing_round_robin_caller_ids_and_replica_targets(queue, make_producer, redis_client):
    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4)
    assert p.shards == 4 and await redis_client.hget(keys.config, "shards") == b"4"
    handles = await bounded(p.submit_many([{"prompt": f"g{i}", "sampling": SAMPLING} for i in range(400)]), 20, "400 jobs")
    per_shard = await shard_ids(redis_client, keys, k)
    assert [len(ids) for ids in per_shard] == [100, 100, 100, 100]
    assert sorted(i for ids in per_shard for i in ids) == sorted(h.id for h in handles)

    chosen = [f"chosen-{i}" for i in range(60)]
    first = await p.submit_many([{"id": i, "prompt": "c", "sampling": SAMPLING} for i in chosen])
    assert not any(h.duplicate for h in first)
    after = await shard_ids(redis_client, keys, k)
    for i in chosen:  # each in its shard, once, nowhere else
        assert [s for s in range(k) if i in after[s]] == [shard_of_id(i, k)]
    for s in range(k):  # recorded in its shard's ids hash (idempotency is per shard)
        mine = [i for i in chosen if shard_of_id(i, k) == s]
        assert set(await redis_client.hkeys(keys.shard(s).ids)) == {i.encode() for i in mine}

    # Resubmitting the same ids is a no-op in their shards, single or batched.
    again = await p.submit_many([{"id": i, "prompt": "c", "sampling": SAMPLING} for i in chosen])
    one = await p.submit("c", id=chosen[0], sampling=SAMPLING)
    assert all(h.duplicate for h in again) and one.duplicate
    assert await shard_ids(redis_client, keys, k) == after

    # A job targeted at a replica goes to the replica's home shard, in its own stream.
    replicas = [f"rep-{i}" for i in range(6)]
    targeted = await p.submit_many([{"prompt": "t", "replica": r, "sampling": SAMPLING} for r in replicas])
    for r, h in zip(replicas, targeted):
        home = keys.shard(home_shard(r, k))
        assert await stream_ids(redis_client, home.replica_jobs(r)) == [h.id]
        assert h._entry[0] == home.replica_jobs(r)
    assert await shard_ids(redis_client, keys, k) == after  # nothing in the shared streams


async def test_one_shard_keeps_the_unsharded_keys(queue, make_producer, redis_client):
    keys = QueueKeys(queue)
    p = await make_producer(queue)  # shards=None, no record: one shard
    await p.submit_many([{"prompt": "x", "sampling": SAMPLING}] * 10)
    assert p.shards == 1 and p._result_keys == [keys.results(p.id)] and p._calls_keys == [keys.submit_calls(p.id)]
    assert await redis_client.xlen(keys.jobs) == 10
    assert not await redis_client.exists(keys.shard(1).jobs)


# -- 2. results from every shard -----------------------------------------------------------
async def test_results_from_every_shard_arrive_once(queue, make_producer, redis_client):
    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4)
    specs = [{"prompt": "g", "sampling": SAMPLING} for _ in range(40)]
    specs += [{"id": f"c-{i}", "prompt": "c", "sampling": SAMPLING} for i in range(20)]
    handles = await p.submit_many(specs)
    assert await answer_all(redis_client, keys, k, p.id) == 60
    by_handle = [await bounded(h.result(), 10, f"the result of {h.id}") for h in handles[:10]]
    assert {r.replica for r in by_handle} == {f"shard{s}" for s in range(k)}  # round robin: all four
    got = await collect(p, 50, timeout=10, settle=0.3)
    assert sorted(got) == sorted(h.id for h in handles[10:])
    assert all(len(v) == 1 for v in got.values()) and p.outstanding == 0
    # Every entry was read and deleted, in each shard.
    for s in keys.shards(k):
        await until(lambda s=s: _empty(redis_client, s.results(p.id)), 5, f"shard {s.shard_index}'s results read")
    await p.close()
    for s in keys.shards(k):  # close() removes every shard's result stream and call record
        assert not await redis_client.exists(s.results(p.id), s.submit_calls(p.id))


async def _empty(client, key: str) -> bool:
    return await client.xlen(key) == 0


async def test_results_through_real_consumers(queue, make_producer, make_consumer, redis_client):
    """End to end: a replica of a 4-shard queue (the echo engine) drains every shard."""
    p = await make_producer(queue, shards=4)
    handles = await p.submit_many([{"prompt": f"x{i}", "sampling": SAMPLING} for i in range(200)])
    assert [await redis_client.xlen(s.jobs) for s in QueueKeys(queue).shards(4)] == [50] * 4
    c = make_consumer(queue)  # shards=None: follows the queue's record
    make_consumer.start(c)
    got = await collect(p, 200, timeout=30)
    assert sorted(got) == sorted(h.id for h in handles) and all(len(v) == 1 for v in got.values())


# -- 3. staleness bound over shards ----------------------------------------------------------
async def _admitted(client, keys: QueueKeys, k: int) -> list[int]:
    return [int(await client.hget(s.admission, "admitted") or 0) for s in keys.shards(k)]


async def _queued(client, keys: QueueKeys, k: int) -> int:
    return sum([await client.xlen(s.jobs) for s in keys.shards(k)])


async def test_staleness_bound_split_over_shards_follows_the_mirrored_version(queue, make_producer, redis_client, tmp_path):
    import torch

    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4, admission_poll=0.02)
    with pytest.raises(ValueError, match="smaller than the queue's 4 shards"):
        await p.set_staleness_bound(max_lag=0, batch=3)
    await p.set_staleness_bound(max_lag=0, batch=8)
    for s, part in zip(keys.shards(k), split_budget(8, k)):
        assert await redis_client.hmget(s.config, "max_lag", "batch") == [b"0", str(part).encode()]

    tasks = [asyncio.create_task(p.submit(f"x{i}", sampling=SAMPLING)) for i in range(24)]
    try:
        # (max_lag + version + 1) * batch = (0 + 0 + 1) * 8: two per shard, the rest wait.
        await until(lambda: _queued(redis_client, keys, k), 10, "the first jobs admitted")
        await until(lambda: sum(t.done() for t in tasks) >= 8, 10, "8 submissions admitted")
        await asyncio.sleep(0.2)  # the waiting ones poll again (admission_poll=0.02): still refused
        assert await _admitted(redis_client, keys, k) == [2, 2, 2, 2]
        assert await _queued(redis_client, keys, k) == 8 and sum(t.done() for t in tasks) == 8

        # Version 1 (committed in shard 0, mirrored into shards 1-3): 16 in total.
        rec = await p.publish_weights({"w": torch.zeros(4)}, root=str(tmp_path / "weights"))
        assert rec.version == 1
        assert [await redis_client.hget(s.version, "v") for s in keys.shards(k)] == [b"1"] * 4
        await until(lambda: sum(t.done() for t in tasks) >= 16, 10, "16 submissions admitted")
        await asyncio.sleep(0.2)
        assert await _admitted(redis_client, keys, k) == [4, 4, 4, 4]
        assert await _queued(redis_client, keys, k) == 16 and sum(t.done() for t in tasks) == 16

        await p.publish_weights({"w": torch.ones(4)})  # version 2: 24
        await bounded(asyncio.gather(*tasks), 10, "every submission admitted")
        assert await _admitted(redis_client, keys, k) == [6, 6, 6, 6]
        assert sorted(i for ids in await shard_ids(redis_client, keys, k) for i in ids) == sorted(t.result().id for t in tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    await p.set_staleness_bound(None)
    for s in keys.shards(k):
        assert await redis_client.hmget(s.config, "max_lag", "batch") == [None, None]


async def test_a_refusal_in_one_shard_loses_and_doubles_nothing(queue, make_producer, redis_client):
    """Not blocking: a batch over four shards of which one is full is enqueued in the other
    three; the error holds their handles and the refused jobs, which go in later."""
    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4, block_when_full=False)
    await p.set_staleness_bound(max_lag=0, batch=8)
    full = ids_with_shard(0, k, 2, prefix="fill")
    await p.submit_many([{"id": i, "prompt": "f", "sampling": SAMPLING} for i in full])  # shard 0: 2 of 2
    specs = [{"id": i, "prompt": "x", "sampling": SAMPLING} for s in range(k) for i in ids_with_shard(s, k, 1, prefix=f"b{s}")]
    with pytest.raises(StalenessBound, match="shard 0/4") as ei:
        await p.submit_many(specs)
    err = ei.value
    enqueued, refused = [h.id for h in err.enqueued], [j.id for j in err.refused]
    assert sorted(enqueued + refused) == sorted(s["id"] for s in specs) and not set(enqueued) & set(refused)
    assert [shard_of_id(i, k) for i in refused] == [0]
    assert await _admitted(redis_client, keys, k) == [2, 1, 1, 1]
    assert sorted(i for ids in await shard_ids(redis_client, keys, k) for i in ids) == sorted(full + enqueued)
    assert p.outstanding == 5

    await commit_version(redis_client, keys, VersionRecord(version=1, transport="memmap", checksum="0", num_tensors=0, nbytes=0))
    later = await p.submit_many(err.refused)
    assert [h.id for h in later] == refused and not later[0].duplicate
    assert sorted(i for ids in await shard_ids(redis_client, keys, k) for i in ids) == sorted(full + enqueued + refused)


async def test_version_mirror_never_lowers_and_one_shard_has_none(queue, redis_client):
    keys = QueueKeys(queue)

    def rec(v: int) -> VersionRecord:
        return VersionRecord(version=v, transport="memmap", checksum="0", num_tensors=0, nbytes=0)

    assert await commit_version(redis_client, keys, rec(1))  # no shard count recorded: one shard
    assert not await redis_client.exists(keys.shard(1).version)
    await redis_client.hset(keys.config, "shards", 3)
    await redis_client.hset(keys.shard(2).version, "v", 9)  # a mirror ahead (a newer publisher's)
    assert await commit_version(redis_client, keys, rec(5))
    assert [await redis_client.hget(s.version, "v") for s in keys.shards(3)] == [b"5", b"5", b"9"]
    assert not await redis_client.hexists(keys.shard(1).version, "d")  # the record stays in shard 0
    assert not await commit_version(redis_client, keys, rec(4))  # older: neither record nor mirror
    assert await redis_client.hget(keys.shard(1).version, "v") == b"5"


# -- 4. cancel in the job's shard ----------------------------------------------------------
async def test_cancel_a_queued_job_in_shard_3(queue, make_producer, redis_client):
    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4)
    chosen = ids_with_shard(3, k, 1)[0]
    h = await p.submit("c", id=chosen, sampling=SAMPLING)
    generated = await p.submit_many([{"prompt": "g", "sampling": SAMPLING}] * 4)  # one per shard
    in3 = [g for g in generated if g._entry[0] == keys.shard(3).jobs]
    assert len(in3) == 1 and h._entry[0] == keys.shard(3).jobs
    s3 = keys.shard(3)
    assert sorted(await stream_ids(redis_client, s3.jobs)) == sorted([chosen, in3[0].id])
    assert await h.cancel() and await in3[0].cancel()
    assert await stream_ids(redis_client, s3.jobs) == []
    assert not await redis_client.hexists(s3.ids, chosen)
    assert await redis_client.hget(s3.stats, "cancelled") == b"2"
    assert [await redis_client.xlen(s.jobs) for s in keys.shards(3)] == [1, 1, 1]  # the others stay
    assert p.outstanding == 3


# -- 5. a cluster: the chunked path, lost replies ------------------------------------------
@pytest.mark.slow
async def test_cluster_chunks_over_three_shards_with_lost_replies(redis_cluster, monkeypatch):
    from rollq.producer import _submission as submission_mod

    k = 3
    queue = redis_cluster.queue_on(0)
    keys = QueueKeys(queue)
    p = Producer(redis_cluster.url, queue, settings=ProducerSettings(shards=k, script_batch=200, chunk_size=1000))
    c = connect(redis_cluster.url)
    real = submission_mod.Submission._run_scripts_now
    lost = []

    async def lose_replies(self, calls):
        out = await real(self, calls)
        if len(lost) < 2:  # two rounds ran in Redis, their replies are lost: resent
            lost.append(out)
            raise RedisConnectionError("reply lost")
        return out

    monkeypatch.setattr(submission_mod.Submission, "_run_scripts_now", lose_replies)
    try:
        await p.connect()
        handles = await bounded(p.submit_many([{"prompt": f"x{i}", "sampling": SAMPLING} for i in range(3000)]), 60, "3000 jobs")
        assert len(lost) == 2 and p.counters["resends"] == 2
        per_shard = [await stream_ids(c, s.jobs) for s in keys.shards(k)]
        assert [len(ids) for ids in per_shard] == [1000, 1000, 1000]
        every = Counter(i for ids in per_shard for i in ids)
        assert set(every.values()) == {1} and sorted(every) == sorted(h.id for h in handles)
        # Results from the three shards (three readers on a cluster) reach the producer.
        await answer_all(c, keys, k, p.id)
        got = await collect(p, 3000, timeout=30, settle=0.2)
        assert len(got) == 3000 and all(len(v) == 1 for v in got.values())
    finally:
        await p.close()
        for s in keys.shards(k):
            assert not await c.exists(s.results(p.id))
            assert not await c.exists(s.submit_calls(p.id))
        await c.aclose()


async def test_submit_interrupted_and_resumed_over_shards(queue, redis_server, redis_client):
    """Redis unreachable mid-batch (streamed path, four shards): the error splits the jobs into
    enqueued, in doubt and not sent; resume() enqueues each remaining job once, in its shard."""
    k, keys = 4, QueueKeys(queue)
    proxy = await CutProxy(redis_server.port).start()
    rs = dataclasses.replace(RedisSettings.from_url(proxy.url), command_timeout=1.0, connect_timeout=0.5)
    p = Producer(rs, queue, settings=ProducerSettings(chunk_size=20, script_batch=5, shards=k))
    try:
        await p.connect()
        real = p._submission._read_replies
        reads = []

        async def read_then_go_dark(conn, calls, reran):
            reads.append(1)
            if len(reads) == 2:
                proxy.dark = True
                proxy.cut()
            return await real(conn, calls, reran)

        p._submission._read_replies = read_then_go_dark
        jobs = p.build_jobs([{"prompt_token_ids": [i + 1], "sampling": SAMPLING} for i in range(80)])
        with pytest.raises(SubmitInterrupted) as ei:
            await bounded(p.submit_many(jobs), 15, "the interrupted submission")
        err = ei.value
        parts = [[h.id for h in err.enqueued], [j.id for j in err.in_doubt], [j.id for j in err.not_sent]]
        assert err.enqueued and err.in_doubt
        proxy.dark = False
        del p._submission._read_replies
        more = await bounded(err.resume(), 10, "the resumed submission")
        assert sorted(parts[0] + [h.id for h in more]) == sorted(j.id for j in jobs)
        every = Counter(i for ids in await shard_ids(redis_client, keys, k) for i in ids)
        assert sorted(every) == sorted(j.id for j in jobs) and set(every.values()) == {1}
        assert [len(ids) for ids in await shard_ids(redis_client, keys, k)] == [20, 20, 20, 20]
    finally:
        proxy.dark = False
        await p.close()
        await proxy.stop()


# -- 6. the shard count at connect -----------------------------------------------------------
async def test_shard_count_is_agreed_at_connect(queue, redis_url, redis_client):
    first = await Producer(redis_url, queue, settings=ProducerSettings(shards=4)).connect()
    try:
        other = Producer(redis_url, queue, settings=ProducerSettings(shards=2))
        with pytest.raises(ShardCountMismatch, match="has 4 shard"):
            await other.connect()
        assert other._client is None and other._reader is None  # nothing left running
        follower = await Producer(redis_url, queue).connect()  # shards=None follows the record
        assert follower.shards == 4
        await follower.close()
    finally:
        await first.close()


async def test_call_records_of_a_rarely_called_shard_are_trimmed(queue, make_producer, redis_client):
    """Call numbers are one sequence per producer: a shard called again after many calls to
    another deletes its read records by the fields it holds (submit.lua's long-gap branch)."""
    k, keys = 4, QueueKeys(queue)
    p = await make_producer(queue, shards=4)
    to1, to0 = ids_with_shard(1, k, 2, prefix="one"), ids_with_shard(0, k, 100, prefix="zero")
    await p.submit("a", id=to1[0], sampling=SAMPLING)
    rec1 = keys.shard(1).submit_calls(p.id)
    assert set(await redis_client.hkeys(rec1)) == {b"1", b"inc", b"lo"}
    for i in to0:  # numbers 2..101, all in shard 0's record
        await p.submit("z", id=i, sampling=SAMPLING)
    await p.submit("b", id=to1[1], sampling=SAMPLING)  # number 102: 1..101 were read
    assert set(await redis_client.hkeys(rec1)) == {b"102", b"inc", b"lo"}
    assert await redis_client.hget(rec1, "lo") == b"102"
    assert len(await redis_client.hkeys(keys.submit_calls(p.id))) <= 3  # shard 0 trims as it goes
