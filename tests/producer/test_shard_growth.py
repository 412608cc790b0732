"""A queue that grows from one shard to three while jobs with caller ids are queued
(rollq/shards.py: the record's ``grown`` field, submit.lua's count guard and check calls), a
producer connected before the growth, and a publisher that died between the commit script
and the per-shard version mirror (rollq/weightsync/versions.py).

The replica side is played by the test (tests/producer/test_shards.py's helpers): jobs stay
queued until it answers them, so "queued or running" is exact, not a race.
"""

from __future__ import annotations

import pytest

from rollq.connection import PUBLISH_VERSION
from rollq.errors import StalenessBound
from rollq.keys import QueueKeys
from rollq.protocol import Result, decode_job, encode_result
from rollq.shards import declare_shards, shard_of_id
from rollq.weightsync.versions import VersionRecord, encode_record
from tests.helpers import bounded, collect
from tests.producer.test_shards import SAMPLING, answer_all, shard_ids

K = 3


async def answer_owners(client, keys: QueueKeys, k: int) -> int:
    """Play the replicas: every queued job of every shard gets a result in its producer's
    result stream of the job's shard (and leaves its stream). Returns how many."""
    n = 0
    for s in keys.shards(k):
        for eid, f in await client.xrange(s.jobs, count=100_000):
            job = decode_job(f[b"d"])
            await client.xadd(s.results(job.reply), {"d": encode_result(Result(id=job.id, replica="r"))})
            await client.xdel(s.jobs, eid)
            n += 1
    return n


def _all(ids: list[list[str]]) -> list[str]:
    return sorted(i for part in ids for i in part)


async def _admitted(client, keys: QueueKeys, k: int) -> list[int]:
    return [int(await client.hget(s.admission, "admitted") or 0) for s in keys.shards(k)]


async def test_ids_queued_before_growth_are_not_enqueued_again_by_a_producer_that_knows_k3(
        queue, make_producer, redis_client):
    """60 caller ids queued in the one shard; the queue grows to 3; a producer that knows 3
    resubmits all 60 (40 or so map to shards 1 and 2, where shard 0's records are not):
    every one is a duplicate, nothing is enqueued, and each id gets one result."""
    keys = QueueKeys(queue)
    ids = [f"g-{i}" for i in range(60)]
    assert {shard_of_id(i, K) for i in ids} == {0, 1, 2}
    old = await make_producer(queue, producer_id="old")  # no count named: one shard
    await old.submit_many([{"id": i, "prompt": "x", "sampling": SAMPLING} for i in ids])
    new = await make_producer(queue, producer_id="new", shards=K)  # records 3: the queue grows
    assert new.shards == K
    again = await new.submit_many([{"id": i, "prompt": "x", "sampling": SAMPLING} for i in ids])
    assert all(h.duplicate for h in again), [h.id for h in again if not h.duplicate]
    assert _all(await shard_ids(redis_client, keys, K)) == sorted(ids)

    assert await answer_all(redis_client, keys, K, "old") == 60
    got = await collect(old, 60, 10)
    assert sorted(got) == sorted(ids) and all(len(r) == 1 for r in got.values())


async def test_a_producer_connected_before_growth_learns_the_count_at_its_next_submit(
        queue, make_producer, redis_client):
    """The other order: the producer that knows 3 submits first, then one connected before
    the growth (it believes one shard) submits the same ids and new ones. Its calls in
    shard 0 are refused by the count guard; it learns 3, routes again, and its repeats are
    duplicates; its new ids go to their shards under 3 and their results come back."""
    keys = QueueKeys(queue)
    old = await make_producer(queue, producer_id="old")
    await old.submit("warm-up", id="w", sampling=SAMPLING)  # ran unsharded: shard 0 holds an id
    new = await make_producer(queue, producer_id="new", shards=K)
    first = [f"a-{i}" for i in range(30)]
    await new.submit_many([{"id": i, "prompt": "x", "sampling": SAMPLING} for i in first])
    assert old.shards == 1
    fresh = [f"b-{i}" for i in range(30)]
    hs = await old.submit_many([{"id": i, "prompt": "x", "sampling": SAMPLING} for i in first + fresh])
    assert old.shards == K
    assert [h.duplicate for h in hs] == [True] * 30 + [False] * 30
    by_shard = await shard_ids(redis_client, keys, K)
    assert _all(by_shard) == sorted(["w", *first, *fresh])
    for i in fresh:
        assert i in by_shard[shard_of_id(i, K)]

    assert await answer_owners(redis_client, keys, K) == 61
    got = await collect(old, 61, 10)  # the repeats: JobRejected, queued for "new"
    assert all(len(r) == 1 for r in got.values())
    assert sorted(i for i, r in got.items() if r[0].ok) == sorted(["w", *fresh])
    assert {r[0].error.type for i, r in got.items() if i in first} == {"JobRejected"}
    got = await collect(new, 30, 10)
    assert sorted(got) == sorted(first) and all(len(r) == 1 for r in got.values())


async def test_a_stale_producer_setting_the_staleness_bound_learns_the_count(queue, make_producer, redis_client):
    """Bound (0, 90) set on one shard, the queue grows to 3 (the bound split 30/30/30), then
    the producer connected before the growth sets (0, 90) again: the parts still add up to
    90, and 150 submissions admit 90."""
    keys = QueueKeys(queue)
    old = await make_producer(queue, producer_id="old", block_when_full=False, max_outstanding=1000)
    await old.set_staleness_bound(0, 90)
    assert await declare_shards(redis_client, keys, K) == K
    await old.set_staleness_bound(0, 90)
    assert old.shards == K
    parts = [int((await redis_client.hget(s.config, "batch")) or 0) for s in keys.shards(K)]
    assert parts == [30, 30, 30]

    admitted = 0
    for _ in range(150):
        try:
            await old.submit("x", sampling=SAMPLING)
            admitted += 1
        except StalenessBound:
            pass
    assert admitted == 90 and sum(await _admitted(redis_client, keys, K)) == 90


async def _commit_only(client, keys: QueueKeys, version: int) -> None:
    """The commit step of a publisher that dies before it mirrors the version: the commit
    script, as commit_version runs it, and nothing after."""
    rec = VersionRecord(version=version, transport="memmap", checksum="0", num_tensors=0, nbytes=0)
    await PUBLISH_VERSION(client, [keys.version, keys.versions_log, keys.config],
                          [version, encode_record(rec), keys.control, 100])


async def test_a_version_committed_without_its_mirrors_admits_the_next_submissions(
        queue, make_producer, redis_client):
    """Bound (0, 3) over 3 shards: one job each at version 0. Version 1 is committed and the
    publisher dies before the mirror (shards 1 and 2 still hold 0): a blocking submit in
    shard 1 and a non-blocking one in shard 2 are admitted without any newer version, and the
    mirrors read 1 afterwards."""
    keys = QueueKeys(queue)
    p = await make_producer(queue, producer_id="p", shards=K, admission_poll=0.05)
    nb = await make_producer(queue, producer_id="nb", block_when_full=False)
    await p.set_staleness_bound(0, 3)
    await p.submit_many([{"prompt": "fill", "sampling": SAMPLING}] * 3)  # round robin: one per shard
    assert await _admitted(redis_client, keys, K) == [1, 1, 1]

    await _commit_only(redis_client, keys, 1)
    assert [await redis_client.hget(s.version, "v") for s in keys.shards(K)] == [b"1", None, None]
    in1 = next(f"s1-{i}" for i in range(100) if shard_of_id(f"s1-{i}", K) == 1)
    in2 = next(f"s2-{i}" for i in range(100) if shard_of_id(f"s2-{i}", K) == 2)
    h = await bounded(p.submit("x", id=in1, sampling=SAMPLING), 10, "a blocking submit in shard 1")
    assert not h.duplicate
    h2 = await nb.submit("x", id=in2, sampling=SAMPLING)  # StalenessBound while the mirror lags
    assert not h2.duplicate
    assert [await redis_client.hget(s.version, "v") for s in keys.shards(K)] == [b"1", b"1", b"1"]
    assert await _admitted(redis_client, keys, K) == [1, 2, 2]


@pytest.mark.parametrize("first", ["old", "new"])
async def test_stale_and_new_producers_interleaved_enqueue_each_id_once(queue, make_producer, redis_client, first):
    """Both producers resubmit the same 40 ids twice each, in either order, after the
    growth; 20 of them were queued before it. Each id is queued once."""
    keys = QueueKeys(queue)
    old = await make_producer(queue, producer_id="old")
    before = [f"c-{i}" for i in range(20)]
    await old.submit_many([{"id": i, "prompt": "x", "sampling": SAMPLING} for i in before])
    new = await make_producer(queue, producer_id="new", shards=K)
    ids = before + [f"d-{i}" for i in range(20)]
    specs = [{"id": i, "prompt": "x", "sampling": SAMPLING} for i in ids]
    order = [old, new] if first == "old" else [new, old]
    for p in order * 2:
        await p.submit_many(specs)
    assert _all(await shard_ids(redis_client, keys, K)) == sorted(ids)
