"""A replica serving a sharded queue (rollq/shards.py).

Jobs are put on the shard streams here the way the producer routes them: a caller-chosen id
goes to ``shard_of_id(id, K)``, a job targeted at a replica to the replica's home shard's
targeted stream, each through the SUBMIT script with that shard's keys and the protocol's
encoder. Results are read from each shard's result stream directly, so every test checks
where each result went, not only that it arrived.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgpack
import pytest
import redis
from redis.crc import key_slot

from rollq.connection import SUBMIT, connect, load_scripts
from rollq.consumer.engine import EchoEngine
from rollq.errors import JobCancelled, ShardCountMismatch
import rollq.consumer._lease as lease_mod
from rollq.keys import GROUP, QueueKeys
from rollq.protocol import Result, decode_result, encode_job, job_from_spec
from rollq.shards import SHARDS_FIELD, declare_shards, home_shard, shard_of_id
from tests.helpers import bounded, pending_of, run_burst, until
from tests.helpers.blocked import addrs_of, blocked_in

K = 4
PRODUCER = "p0"
ONE = {"sampling": {"max_tokens": 1}}
_pack = msgpack.Packer(use_bin_type=False).pack


def ids_in(shard: int, k: int, n: int, prefix: str = "j") -> list[str]:
    """``n`` caller-chosen job ids that the producer routes to ``shard`` of ``k``."""
    out: list[str] = []
    for i in range(100_000):
        jid = f"{prefix}{i}"
        if shard_of_id(jid, k) == shard:
            out.append(jid)
            if len(out) == n:
                return out
    raise AssertionError(f"no {n} ids for shard {shard} of {k}")


def replica_id(k: int, *, home: int | None = None, not_home: set[int] = frozenset(), prefix: str = "r") -> str:
    """A replica name whose home shard (of ``k``) is ``home``, or is not in ``not_home``."""
    for i in range(100_000):
        name = f"{prefix}{i}"
        h = home_shard(name, k)
        if (home is None or h == home) and h not in not_home:
            return name
    raise AssertionError("no replica name found")


async def put(client: Any, keys: QueueKeys, job_id: str, k: int, *, spec: dict | None = None,
              replica: str | None = None) -> tuple[int, bytes]:
    """Submit one job as a shard-aware producer would: ``shard_of_id`` for its id, or the
    home shard of ``replica``'s targeted stream. Returns (shard, entry id)."""
    i = home_shard(replica, k) if replica else shard_of_id(job_id, k)
    shard = keys.shard(i)
    job = job_from_spec({"prompt": job_id, **(spec or ONE)}, id=job_id, reply=PRODUCER, tracked=True)
    stream = shard.job_stream(replica)
    dup, refused, _, eids, _ = await SUBMIT(client, shard.submit_keys(stream), [_pack([job_id, encode_job(job)]), PRODUCER])
    assert not dup and not refused, f"SUBMIT refused job {job_id}"
    return i, eids[0]


async def results_by_shard(client: Any, keys: QueueKeys, k: int) -> dict[int, list[Result]]:
    """Every result recorded for PRODUCER, per shard whose result stream holds it."""
    out: dict[int, list[Result]] = {}
    for i in range(k):
        for _, fields in await client.xrange(keys.shard(i).results(PRODUCER)):
            if b"d" in fields:
                out.setdefault(i, []).append(decode_result(fields[b"d"]))
            else:
                out.setdefault(i, []).extend(decode_result(d) for d in msgpack.unpackb(fields[b"b"], raw=True))
    return out


def answered(by_shard: dict[int, list[Result]]) -> dict[str, list[tuple[int, Result]]]:
    """job id -> [(shard of its result stream, result)]."""
    got: dict[str, list[tuple[int, Result]]] = {}
    for i, rs in by_shard.items():
        for r in rs:
            got.setdefault(r.id, []).append((i, r))
    return got


async def count_results(client: Any, keys: QueueKeys, k: int) -> int:
    return sum(len(rs) for rs in (await results_by_shard(client, keys, k)).values())


def assert_once_each(got: dict[str, list[tuple[int, Result]]], placed: dict[str, int]) -> None:
    """Every placed job answered exactly once, ok, in its own shard's result stream."""
    assert sorted(got) == sorted(placed), f"missing {sorted(set(placed) - set(got))[:10]}"
    for jid, rs in got.items():
        assert len(rs) == 1, f"job {jid} answered {len(rs)} times"
        shard, r = rs[0]
        assert r.ok, f"job {jid} failed: {r.error}"
        assert shard == placed[jid], f"result of job {jid} (shard {placed[jid]}) went to shard {shard}'s stream"


async def assert_shards_drained(client: Any, keys: QueueKeys, k: int) -> None:
    """No job entry, recorded id or pending delivery is left in any shard."""
    for i in range(k):
        s = keys.shard(i)
        assert await client.xlen(s.jobs) == 0, f"shard {i} still holds job entries"
        assert await client.hlen(s.ids) == 0, f"shard {i} still records job ids"
        pending = await client.xpending(s.jobs, GROUP)
        assert pending["pending"] == 0, f"shard {i} has pending entries"


async def test_two_replicas_answer_every_shard_once(queue, make_consumer, redis_client):
    """Jobs of 0.3 s in 4 shards, two replicas: each job answered once, in its shard's result
    stream, and never taken from a live replica (each keeps a lease in every shard)."""
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    placed = {}
    for i in range(K):
        for jid in ids_in(i, K, 15, prefix=f"a{i}-"):
            placed[jid] = (await put(redis_client, keys, jid, K, spec={"sampling": {"max_tokens": 3}}))[0]
    cs = [make_consumer(queue, consumer_id=f"c{n}", shards=K, max_inflight=8, initial_inflight=8, batch=4,
                        engine=EchoEngine(delay_per_token=0.1)) for n in range(2)]
    codes = await bounded(asyncio.gather(*(run_burst(c, 30) for c in cs)), 40, "both replicas to drain")
    assert codes == [0, 0]
    got = answered(await results_by_shard(redis_client, keys, K))
    assert_once_each(got, placed)
    assert sum(c.counters.completed for c in cs) == len(placed)
    assert all(r.deliveries == 1 for rs in got.values() for _, r in rs), "a live replica's job was reclaimed"
    assert [c.counters.reclaimed for c in cs] == [0, 0]
    for i in range(K):
        stats = await redis_client.hgetall(keys.shard(i).stats)
        assert int(stats[b"completed"]) == 15, f"shard {i} counted {stats.get(b'completed')} completions"
    await assert_shards_drained(redis_client, keys, K)


async def test_one_replica_drains_shards_other_than_its_home(queue, make_consumer, redis_client):
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    cid = replica_id(K, home=2)
    placed = {}
    for i in range(K):
        for jid in ids_in(i, K, 5, prefix=f"b{i}-"):
            placed[jid] = (await put(redis_client, keys, jid, K))[0]
    c = make_consumer(queue, consumer_id=cid, shards=K)
    assert await run_burst(c, 20) == 0
    got = answered(await results_by_shard(redis_client, keys, K))
    assert_once_each(got, placed)
    assert all(r.replica == cid for rs in got.values() for _, r in rs)
    await assert_shards_drained(redis_client, keys, K)


async def test_a_shard_that_is_no_replicas_home_is_served(queue, make_consumer, redis_client):
    """Two replicas whose homes are not shard 3, blocking for a second at a time: a job put
    on shard 3 while they block is answered (within a few block periods)."""
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    names = [replica_id(K, not_home={3}, prefix=f"n{n}-") for n in range(2)]
    cs = [make_consumer(queue, consumer_id=name, shards=K, block=1.0) for name in names]
    for c in cs:
        make_consumer.start(c)
    await until(lambda: all(c.state == "serving" for c in cs), 10, "the replicas to serve")

    async def both_blocked() -> bool:
        blocked = await blocked_in(redis_client, "xreadgroup")
        return all(addrs_of(c._ctx.block_redis) & blocked for c in cs)

    await until(both_blocked, 10, "both replicas blocked on their home shards")
    jid = ids_in(3, K, 1, prefix="orphan-")[0]
    await put(redis_client, keys, jid, K)

    async def done() -> bool:
        return await count_results(redis_client, keys, K) >= 1

    await until(done, 10, "the job on shard 3 to be answered")
    got = answered(await results_by_shard(redis_client, keys, K))
    assert_once_each(got, {jid: 3})


async def test_a_busy_home_shard_does_not_starve_the_others(queue, make_consumer, redis_client):
    """A replica whose home shard always has more jobs than it has room for still reads the
    other shards (once per ``block`` period): a job on shard 2 does not wait until the home
    shard is drained."""
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    home = ids_in(0, K, 60, prefix="h-")
    for jid in home:
        await put(redis_client, keys, jid, K)
    other = ids_in(2, K, 1, prefix="o-")[0]
    await put(redis_client, keys, other, K)
    c = make_consumer(queue, consumer_id=replica_id(K, home=0), shards=K, max_inflight=2, initial_inflight=2,
                      batch=2, block=0.2, engine=EchoEngine(delay_per_token=0.05))
    assert await run_burst(c, 30) == 0
    got = answered(await results_by_shard(redis_client, keys, K))
    assert_once_each(got, {**{jid: 0 for jid in home}, other: 2})
    finished = got[other][0][1].finished
    after = sum(1 for jid in home if got[jid][0][1].finished > finished)
    assert after >= 20, f"the shard-2 job finished after all but {after} of the 60 home-shard jobs"


async def test_survivor_takes_over_jobs_of_two_shards(queue, redis_url, make_consumer, spawn, redis_client):
    """A replica process killed while it runs jobs from two shards (one its home, one not):
    the survivor reclaims both, and each job is answered once, by the survivor."""
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)  # the process follows the record (shards None)
    victim_id = replica_id(K, home=1, prefix="victim")
    slow = {"sampling": {"max_tokens": 30}}  # 100 ms a token: 3 s each
    placed = {ids_in(1, K, 1, "v1-")[0]: 1, ids_in(3, K, 1, "v3-")[0]: 3}
    victim = spawn(redis_url, queue, victim_id, 100, max_inflight=4, lease_ttl=2, heartbeat=0.5, reclaim=0.5)
    await victim.ready()
    for jid in placed:
        await put(redis_client, keys, jid, K, spec=slow)

    async def holds_both() -> bool:
        return [len(await pending_of(redis_client, keys.shard(i).jobs, victim_id)) for i in (1, 3)] == [1, 1]

    await until(holds_both, 10, "the victim to take the jobs of shards 1 and 3")
    heir = make_consumer(queue, consumer_id=replica_id(K, home=0, prefix="heir"), shards=K, engine=EchoEngine(),
                         lease_ttl=2, heartbeat_interval=0.5, reclaim_interval=0.5)
    make_consumer.start(heir)
    await until(lambda: heir.state == "serving", 5, "the heir to serve")
    victim.kill()

    async def done() -> bool:
        return await count_results(redis_client, keys, K) >= len(placed)

    await until(done, 30, "the victim's jobs to be answered")
    await asyncio.sleep(0.5)  # a second answer would come now
    got = answered(await results_by_shard(redis_client, keys, K))
    assert_once_each(got, placed)
    assert all(r.replica == heir.id and r.deliveries == 2 for rs in got.values() for _, r in rs)
    assert heir.counters.reclaimed == 2


async def test_cancel_of_a_running_job_in_shard_2(queue, make_consumer, redis_client):
    """The cancel mark in the job's shard ends it (no pub/sub hint is sent: the heartbeat
    finds the mark in shard 2)."""
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    c = make_consumer(queue, consumer_id=replica_id(K, home=0), shards=K,
                      engine=EchoEngine(delay_per_token=0.2))
    make_consumer.start(c)
    await until(lambda: c.state == "serving", 5, "the consumer to serve")
    jid = ids_in(2, K, 1, "cx-")[0]
    await put(redis_client, keys, jid, K, spec={"sampling": {"max_tokens": 200}})  # 40 s
    await until(lambda: jid in c.jobs.by_job, 10, "the job of shard 2 to run")
    await redis_client.set(keys.shard(2).cancel(jid), b"1", ex=60)

    async def done() -> bool:
        return await count_results(redis_client, keys, K) >= 1

    await until(done, 10, "the cancelled job's result")
    got = answered(await results_by_shard(redis_client, keys, K))
    assert list(got) == [jid] and len(got[jid]) == 1
    shard, r = got[jid][0]
    assert shard == 2 and not r.ok and r.error.type == JobCancelled.__name__
    assert jid not in c.jobs.by_job


async def test_follower_takes_up_shards_added_later(queue, make_consumer, redis_client, monkeypatch):
    """A replica started on a queue with no record (one shard) serves the 4 shards once the
    record says 4: shared jobs in every shard, a job targeted at it in its new home shard,
    and one targeted at it in its old home (shard 0) before the change."""
    monkeypatch.setattr(lease_mod, "SHARD_RECORD_INTERVAL", 0.5)  # 10 s in production
    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    cid = replica_id(K, home=3)
    c = make_consumer(queue, consumer_id=cid)  # shards None: follows the record
    make_consumer.start(c)
    await until(lambda: c.state == "serving", 5, "the consumer to serve")
    assert await redis_client.hget(keys.config, SHARDS_FIELD) is None
    placed = {"before": (await put(redis_client, keys, "before", 1, replica=cid))[0]}
    await redis_client.hset(keys.config, SHARDS_FIELD, K)
    await until(lambda: len(c._ctx.shards) == K, 10, "the consumer to take up the new shards")
    for i in range(K):
        for jid in ids_in(i, K, 3, prefix=f"g{i}-"):
            placed[jid] = (await put(redis_client, keys, jid, K))[0]
    placed["targeted"] = (await put(redis_client, keys, "targeted", K, replica=cid))[0]
    assert placed["targeted"] == 3

    async def done() -> bool:
        return await count_results(redis_client, keys, K) >= len(placed)

    await until(done, 20, "every job to be answered")
    await asyncio.sleep(0.3)
    assert_once_each(answered(await results_by_shard(redis_client, keys, K)), placed)


async def test_consumer_naming_another_count_is_refused(queue, make_consumer, redis_client):
    keys = QueueKeys(queue)
    await declare_shards(redis_client, keys, K)
    c = make_consumer(queue, consumer_id="two", shards=2)
    with pytest.raises(ShardCountMismatch, match="has 4 shard"):
        await bounded(c.run(burst=True), 10, "the consumer to refuse the count")
    assert await redis_client.hget(keys.config, SHARDS_FIELD) == b"4"
    assert await redis_client.hget(keys.consumers, "two") is None


# ----------------------------------------------------------------------------------------
# Redis Cluster
# ----------------------------------------------------------------------------------------
def queue_on_distinct_masters(cluster: Any, k: int) -> tuple[str, list[int]]:
    """A fresh queue whose ``k`` shards live on ``k`` different masters, and their nodes."""
    for _ in range(10_000):
        q = f"s-{uuid.uuid4().hex[:10]}"
        nodes = [cluster.node_of_slot(key_slot(s.jobs.encode())) for s in QueueKeys(q).shards(k)]
        if len(set(nodes)) == k:
            return q, nodes
    raise AssertionError(f"no queue with {k} shards on {k} masters")


@pytest.mark.slow
async def test_cluster_exactly_once_across_shards_on_three_masters(redis_cluster, make_consumer):
    k = 3
    q, nodes = queue_on_distinct_masters(redis_cluster, k)
    keys = QueueKeys(q)
    client = connect(redis_cluster.url)
    try:
        await client.initialize()
        for i, s in enumerate(keys.shards(k)):  # the cluster itself says where each shard lives
            slot = await client.cluster_keyslot(s.jobs)
            assert slot == key_slot(s.jobs.encode()) and redis_cluster.node_of_slot(slot) == nodes[i]
        await load_scripts(client)
        await declare_shards(client, keys, k)
        placed = {}
        for i in range(k):
            for jid in ids_in(i, k, 10, prefix=f"k{i}-"):
                placed[jid] = (await put(client, keys, jid, k))[0]
        cs = [make_consumer(q, consumer_id=f"cc{n}", url=redis_cluster.url, shards=k, max_inflight=6,
                            initial_inflight=6, batch=3) for n in range(2)]
        codes = await bounded(asyncio.gather(*(run_burst(c, 40) for c in cs)), 50, "both replicas to drain")
        assert codes == [0, 0]
        assert_once_each(answered(await results_by_shard(client, keys, k)), placed)
        await assert_shards_drained(client, keys, k)
    finally:
        await client.aclose()
        drop_queue_keys(redis_cluster, q)


def drop_queue_keys(cluster: Any, queue: str) -> None:
    """Delete every key of ``queue``'s shards on every node: the cluster is the session's, and
    other tests walk its whole keyspace."""
    for i in range(len(cluster.nodes)):
        with redis.Redis.from_url(cluster.node_url(i)) as c:
            for pattern in (f"rollq:{{{queue}}}:*", f"rollq:{{{queue}~*}}:*"):
                for key in list(c.scan_iter(match=pattern, count=1000)):
                    c.delete(key)


async def test_the_reclaimer_mirrors_a_version_its_publisher_did_not(queue, make_consumer, redis_client):
    """A publisher died between the commit script and the mirror: shard 0 records version 2,
    the other shards' mirrors still say 1. The replica holding shard 0's reclaimer role
    mirrors version 2 into them, with no newer version and no submit."""
    from rollq.connection import PUBLISH_VERSION
    from rollq.weightsync.versions import VersionRecord, commit_version, encode_record

    keys = QueueKeys(queue)
    await load_scripts(redis_client)
    await declare_shards(redis_client, keys, K)
    rec = VersionRecord(version=1, transport="memmap", checksum="0", num_tensors=0, nbytes=0)
    await commit_version(redis_client, keys, rec)  # committed and mirrored
    rec2 = VersionRecord(version=2, transport="memmap", checksum="0", num_tensors=0, nbytes=0)
    await PUBLISH_VERSION(redis_client, [keys.version, keys.versions_log, keys.config],
                          [2, encode_record(rec2), keys.control, 100])  # the commit step only
    assert [await redis_client.hget(s.version, "v") for s in keys.shards(K)] == [b"2", b"1", b"1", b"1"]
    c = make_consumer(queue, consumer_id="healer")
    make_consumer.start(c)

    async def mirrored() -> bool:
        return [await redis_client.hget(s.version, "v") for s in keys.shards(K)] == [b"2"] * K

    await until(mirrored, 10, "the mirrors to read version 2")
