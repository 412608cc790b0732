"""Operators' views of a sharded queue: ``queue_status``, the dead-letter tools and the CLI
(``rollq status``, ``rollq dlq``, ``rollq queue create``) over a queue of four shards, and a
queue of one shard costing the commands it always did. Real redis-server, real subprocesses.

Jobs are placed on the shards' streams the way a producer places them (the SUBMIT script on
each shard's keys) and delivered the way a replica takes them (XREADGROUP in the rollq group),
so these tests do not depend on the producer's or the consumer's routing.
"""

from __future__ import annotations

import json
import time
import uuid

import msgpack
import pytest

from rollq.connection import SUBMIT, connect
from rollq.keys import FIELD, GROUP, QUEUES, QueueKeys
from rollq.protocol import DeadLetter, encode_dead_letter, encode_job, make_job
from rollq.shards import SHARDS_FIELD, declare_shards
from rollq.status import dlq_list, dlq_purge, dlq_requeue, queue_status
from tests.test_cli import rollq

pytestmark = pytest.mark.asyncio(loop_scope="function")

K = 4
#: Jobs placed on each shard's stream, and how many of them a replica takes (in flight).
PLACED = [3, 0, 5, 1]
TAKEN = [0, 0, 2, 0]
WAITING = [p - t for p, t in zip(PLACED, TAKEN)]


def _job(n: int, replica: str | None = None):
    return make_job(id=f"j-{uuid.uuid4().hex[:12]}-{n}", reply="op-test", prompt=f"p{n}",
                    sampling={"max_tokens": 4}, replica=replica)


async def place(client, part: QueueKeys, n: int, replica: str | None = None) -> None:
    """Submit ``n`` jobs into one shard as the producer's SUBMIT script does (untracked ids)."""
    for i in range(n):
        job = _job(i, replica)
        await SUBMIT(client, part.submit_keys(part.job_stream(replica)),
                     [msgpack.packb(["", encode_job(job)], use_bin_type=False), job.reply])


async def take(client, part: QueueKeys, n: int, replica: str = "r-op") -> None:
    """Deliver ``n`` entries of a shard's shared stream to ``replica`` (pending, not acked)."""
    try:
        await client.xgroup_create(part.jobs, GROUP, id="0", mkstream=True)
    except Exception as e:  # the group exists already
        assert "BUSYGROUP" in str(e), e
    if n:
        got = await client.xreadgroup(GROUP, replica, {part.jobs: ">"}, count=n)
        assert sum(len(entries) for _, entries in got) == n


async def dead_letter(client, part: QueueKeys, *, valid: bool = True, replica: str | None = None,
                      entry_id: str = "*") -> str:
    """A dead-letter entry in one shard, as a consumer writes it; returns its entry id."""
    payload = encode_job(_job(0, replica)) if valid else b"not a job"
    d = DeadLetter(job_id="dead", reason="boom", error_type="EngineError", consumer="r-op", deliveries=3,
                   at=time.time(), source=part.jobs, payload=payload, payload_bytes=len(payload))
    eid = await client.xadd(part.dlq, {FIELD: encode_dead_letter(d)}, id=entry_id)
    return eid.decode()


@pytest.fixture
async def client(redis_url):
    c = connect(redis_url)
    yield c
    await c.aclose()


async def sharded(client, queue: str) -> QueueKeys:
    """A K-shard queue holding PLACED jobs, TAKEN of them in flight, one dead letter in shards 1 and 3."""
    keys = QueueKeys(queue)
    assert await declare_shards(client, keys, K) == K
    for part, n, t in zip(keys.shards(K), PLACED, TAKEN):
        await place(client, part, n)
        await take(client, part, t)
    for i in (1, 3):
        await dead_letter(client, keys.shard(i))
    return keys


# ----------------------------------------------------------------------------------------
# queue_status and rollq status
# ----------------------------------------------------------------------------------------
async def test_status_sums_the_shards_and_shows_each_ones_depth(client, redis_url, queue):
    keys = await sharded(client, queue)
    # a replica with a targeted job: it waits in the replica's home shard
    from rollq.shards import home_shard

    await client.hset(keys.consumers, "r-op", _replica_info("r-op"))
    home = home_shard("r-op", K)
    await place(client, keys.shard(home), 1, replica="r-op")

    st = await queue_status(client, keys)
    want_depth = list(WAITING)
    want_depth[home] += 1
    assert st.shards == K
    assert st.shard_depth == want_depth and st.depth == sum(want_depth)
    assert st.shard_in_flight == TAKEN and st.in_flight == sum(TAKEN)
    assert st.submitted == sum(PLACED) + 1  # each shard's SUBMIT counted in its own stats hash
    assert st.dlq_length == 2
    assert st.oldest_waiting_s is not None and st.oldest_waiting_s >= 0
    assert [r.id for r in st.replicas] == ["r-op"]

    r = rollq("status", "--queue", queue, "--json", url=redis_url)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shards"] == K and doc["shard_depth"] == want_depth and doc["depth"] == sum(want_depth)
    assert doc["shard_in_flight"] == TAKEN and doc["submitted"] == sum(PLACED) + 1 and doc["dlq_length"] == 2

    human = rollq("status", "--queue", queue, url=redis_url)
    assert human.returncode == 0, human.stderr
    assert "waiting per shard" in human.stdout and " ".join(map(str, want_depth)) in human.stdout


def _replica_info(name: str) -> bytes:
    import msgspec

    from rollq.protocol import ReplicaInfo

    now = time.time()
    return msgspec.msgpack.encode(ReplicaInfo(
        id=name, host="h", pid=1, engine="echo", model="m", device="cpu", version=0, inflight=0, cap=8,
        kv_usage=None, tokens_per_s=0.0, completed=0, failed=0, started_at=now, heartbeat_at=now, state="serving"))


async def test_unsharded_queue_shows_one_shard(client, redis_url, queue):
    keys = QueueKeys(queue)
    await place(client, keys, 4)
    await take(client, keys, 1)
    st = await queue_status(client, keys)
    assert (st.shards, st.shard_depth, st.shard_in_flight, st.depth, st.in_flight) == (1, [3], [1], 3, 1)
    human = rollq("status", "--queue", queue, url=redis_url)
    assert human.returncode == 0 and "waiting per shard" not in human.stdout  # nothing new to read for K=1


def _calls(stats: dict) -> dict[str, int]:
    """Calls per command; Redis 7 names subcommands (``xinfo|groups``), 6.2 only commands
    (``xinfo``): both are counted under the command."""
    out: dict[str, int] = {}
    for name, s in stats.items():
        if name != "cmdstat_info":
            cmd = name[len("cmdstat_"):].split("|")[0]
            out[cmd] = out.get(cmd, 0) + int(s["calls"])
    return out


async def _commands_of(client, coro) -> dict[str, int]:
    before = _calls(await client.info("commandstats"))
    await coro
    after = _calls(await client.info("commandstats"))
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


async def test_one_shard_issues_the_commands_it_always_did(fresh_redis):
    """On a Redis of its own: a queue of one shard costs what the view cost before shards
    existed (given the count; reading it is one HGET), and each extra shard adds its counters,
    dead letters and stream, never a scan."""
    client = connect(fresh_redis.url)
    try:
        one, four = QueueKeys("one"), QueueKeys("four")
        await place(client, one, 2)
        await take(client, one, 0)
        await declare_shards(client, four, 4)
        for part in four.shards(4):
            await place(client, part, 2)
            await take(client, part, 0)

        before_shards = {"hgetall": 3, "xlen": 2, "hget": 1, "xinfo": 1, "xrange": 1}
        assert await _commands_of(client, queue_status(client, one, shards=1)) == before_shards
        assert await _commands_of(client, queue_status(client, one)) == {**before_shards, "hget": 2}
        got = await _commands_of(client, queue_status(client, four))
        assert got == {"hgetall": 3 + 3, "xlen": 2 + 3 + 3, "hget": 2, "xinfo": 4, "xrange": 4}, got
        assert (await queue_status(client, four)).shard_depth == [2, 2, 2, 2]
    finally:
        await client.aclose()


# ----------------------------------------------------------------------------------------
# dead letters over every shard
# ----------------------------------------------------------------------------------------
async def test_dlq_list_requeue_purge_cover_every_shard(client, redis_url, queue):
    keys = QueueKeys(queue)
    await declare_shards(client, keys, K)
    # entry ids are per stream: two shards can hold the same one (here shards 1 and 3)
    e1 = await dead_letter(client, keys.shard(1), entry_id="1000-1")
    e3 = await dead_letter(client, keys.shard(3), entry_id="1000-1")
    bad = await dead_letter(client, keys.shard(2), valid=False, entry_id="2000-0")
    e0 = await dead_letter(client, keys.shard(0), entry_id="3000-0")

    r = rollq("dlq", "list", "--queue", queue, "--json", url=redis_url)
    assert r.returncode == 0, r.stderr
    items = json.loads(r.stdout)
    pairs = [(i["shard"], i["entry_id"]) for i in items]
    assert pairs[:2] == [(0, e0), (2, bad)] and set(pairs[2:]) == {(3, e3), (1, e1)}  # newest first
    assert {i["ref"] for i in items} == {f"0/{e0}", f"2/{bad}", f"3/{e3}", f"1/{e1}"}
    assert {i["shard"]: i["requeueable"] for i in items} == {0: True, 1: True, 2: False, 3: True}
    assert [v.ref for v in await dlq_list(client, keys, count=2)] == [f"0/{e0}", f"2/{bad}"]

    # by ref: back onto the shard whose dead-letter stream held it, and only that one
    r = rollq("dlq", "requeue", f"3/{e3}", "--queue", queue, "--json", url=redis_url)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"requeued": 1, "skipped": 0}
    assert await client.xlen(keys.shard(3).jobs) == 1 and await client.xlen(keys.shard(3).dlq) == 0
    assert await client.xlen(keys.shard(1).dlq) == 1 and await client.xlen(keys.jobs) == 0

    # a shard the queue does not have: refused with the reason, nothing moved
    r = rollq("dlq", "requeue", f"9/{e1}", "--queue", queue, url=redis_url)
    assert r.returncode == 2 and "shards 0-3" in r.stderr, r.stderr
    assert await client.xlen(keys.shard(1).dlq) == 1

    # a plain entry id is looked up in every shard
    assert await dlq_requeue(client, keys, [e1]) == (1, 0)
    assert await client.xlen(keys.shard(1).jobs) == 1 and await client.xlen(keys.shard(1).dlq) == 0

    # everything else: the valid one requeued, the invalid one stays
    assert await dlq_requeue(client, keys) == (1, 1)
    assert await client.xlen(keys.jobs) == 1 and await client.xlen(keys.shard(2).dlq) == 1

    await dead_letter(client, keys.shard(3))
    r = rollq("dlq", "purge", "--queue", queue, "--json", url=redis_url)
    assert r.returncode == 0 and json.loads(r.stdout) == {"purged": 2}, r.stderr
    assert [await client.xlen(p.dlq) for p in keys.shards(K)] == [0, 0, 0, 0]
    assert await dlq_purge(client, keys) == 0


async def test_unsharded_dead_letters_keep_plain_entry_ids(client, queue):
    keys = QueueKeys(queue)
    e = await dead_letter(client, keys)
    (v,) = await dlq_list(client, keys)
    assert (v.shard, v.entry_id, v.ref) == (0, e, e)
    assert await dlq_requeue(client, keys, [v.ref]) == (1, 0)
    assert await client.xlen(keys.jobs) == 1


# ----------------------------------------------------------------------------------------
# rollq queue create
# ----------------------------------------------------------------------------------------
async def test_queue_create_records_the_count_and_refuses_another(client, redis_url, queue):
    keys = QueueKeys(queue)
    r = rollq("queue", "create", queue, "--shards", "4", "--json", url=redis_url)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"queue": queue, "shards": 4, "created": True}
    assert await client.hget(keys.config, SHARDS_FIELD) == b"4"
    assert await client.zscore(QUEUES, queue) is not None  # `rollq status` lists it

    again = rollq("queue", "create", queue, "--shards", "4", "--json", url=redis_url)
    assert again.returncode == 0 and json.loads(again.stdout)["created"] is False, again.stderr

    other = rollq("queue", "create", queue, "--shards", "3", url=redis_url)
    assert other.returncode == 1 and "has 4 shard(s), not 3" in other.stderr, other.stderr
    assert await client.hget(keys.config, SHARDS_FIELD) == b"4"

    zero = rollq("queue", "create", f"{queue}-z", "--shards", "0", url=redis_url)
    assert zero.returncode == 2 and "invalid shard count 0" in zero.stderr, zero.stderr
    assert await client.hget(QueueKeys(f"{queue}-z").config, SHARDS_FIELD) is None

    st = json.loads(rollq("status", "--queue", queue, "--json", url=redis_url).stdout)
    assert st["shards"] == 4 and st["shard_depth"] == [0, 0, 0, 0]


# ----------------------------------------------------------------------------------------
# Redis Cluster: the shards' keys live in different slots (and mostly on different masters)
# ----------------------------------------------------------------------------------------
async def test_status_and_dead_letters_through_a_cluster(redis_cluster):
    from redis.crc import key_slot

    client = connect(redis_cluster.url)
    try:
        queue = f"t-{uuid.uuid4().hex[:10]}"
        keys = await sharded(client, queue)
        nodes = {redis_cluster.node_of_slot(key_slot(p.jobs.encode())) for p in keys.shards(K)}
        assert len(nodes) > 1  # else this test would not cross masters (crc32 tags: it does)
        st = await queue_status(client, keys)
        assert st.shard_depth == WAITING and st.shard_in_flight == TAKEN
        assert st.submitted == sum(PLACED) and st.dlq_length == 2
        dead = await dlq_list(client, keys)
        assert sorted(v.shard for v in dead) == [1, 3]
        assert await dlq_requeue(client, keys, [dead[0].ref]) == (1, 0)
        assert await dlq_purge(client, keys) == 1
        assert (await queue_status(client, keys)).dlq_length == 0
    finally:
        await client.aclose()



# ----------------------------------------------------------------------------------------
# rollq submit / consume --shards (the producer and the replica declare the count)
# ----------------------------------------------------------------------------------------
async def test_submit_and_consume_follow_or_refuse_the_recorded_count(redis_url, queue):
    from tests.test_cli import ROOT

    jobs = str(ROOT / "examples" / "jobs.jsonl")
    assert rollq("queue", "create", queue, "--shards", "4", url=redis_url).returncode == 0
    for cmd in (("submit", "--queue", queue, "--shards", "3", jobs),
                ("consume", "--queue", queue, "--engine", "echo", "--burst", "--shards", "3")):
        r = rollq(*cmd, url=redis_url)
        assert r.returncode == 2 and "has 4 shard(s), not 3" in r.stderr, (cmd, r.stderr)

    r = rollq("submit", "--queue", queue, jobs, url=redis_url)  # no --shards: follows the record
    assert r.returncode == 0, r.stderr
    st = json.loads(rollq("status", "--queue", queue, "--json", url=redis_url).stdout)
    assert st["shards"] == 4 and st["depth"] == 3 and sum(st["shard_depth"]) == 3 and st["submitted"] == 3
    c = rollq("consume", "--queue", queue, "--engine", "echo", "--burst", "--shards", "4", "--id", "r-cli", url=redis_url)
    assert c.returncode == 0, c.stderr
    st = json.loads(rollq("status", "--queue", queue, "--json", url=redis_url).stdout)
    assert st["depth"] == 0 and st["shard_depth"] == [0, 0, 0, 0] and st["completed"] == 3
