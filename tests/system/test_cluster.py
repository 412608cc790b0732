"""rollq on a real 3-master Redis Cluster, through a ``redis+cluster://`` URL.

Every test uses queues whose hash tags land on chosen nodes (most use one queue per node), so
routing, scripts, pipelines and pub/sub are exercised on every master, not only on the seed
node the URL names.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import msgpack
import pytest
import redis
from redis.crc import key_slot

from rollq.connection import FINISH, connect
from rollq.consumer.engine import EchoEngine
from rollq.errors import JobCancelled, StalenessBound
from rollq.keys import GROUP, QUEUES, QueueKeys
from rollq.settings import RedisSettings
from rollq.status import dlq_list, dlq_requeue, queue_status
from rollq.weightsync.versions import VersionRecord, commit_version, read_version, version_log
from tests.cluster_fixtures import LocalCluster, slot_of_queue
from tests.helpers import ROOT, bounded, collect, until

pytestmark = pytest.mark.slow

#: Every key rollq writes: ``rollq:{<queue>}:<role>...`` (QueueKeys), the tag being the queue,
#: or ``rollq:{<queue>~<i>}:<role>...`` for shard ``i`` > 0 of a sharded queue.
KEY_RE = re.compile(rb"^rollq:\{([A-Za-z0-9_.\-]{1,128})(~[0-9]{1,3})?\}:[a-z]+(:.*)?$", re.S)


@pytest.fixture
def redis_url(redis_cluster):
    """make_producer / make_consumer (tests/helpers) connect through the cluster URL."""
    return redis_cluster.url


@pytest.fixture
async def cluster_client(redis_cluster):
    c = connect(redis_cluster.url)
    await c.initialize()  # the cluster client learns the slot map lazily; tests ask it directly
    yield c
    await c.aclose()


@pytest.fixture
def node_queues(redis_cluster):
    """One fresh queue per master: queue i's keys all live on node i."""
    return redis_cluster.queues_on_every_node()


def node_keys(cluster: LocalCluster, i: int) -> list[bytes]:
    """Every key stored on node ``i`` (a test-only SCAN on a plain connection to that node)."""
    with redis.Redis.from_url(cluster.node_url(i)) as c:
        return list(c.scan_iter(count=1000))


def queue_keys_on(cluster: LocalCluster, i: int, queue: str) -> list[bytes]:
    tag = f"rollq:{{{queue}}}:".encode()
    return sorted(k for k in node_keys(cluster, i) if k.startswith(tag))


def subscribers(cluster: LocalCluster, channel: str) -> int:
    """Subscribers of ``channel`` over every node (PUBSUB NUMSUB is per node)."""
    n = 0
    for i in range(len(cluster.nodes)):
        with redis.Redis.from_url(cluster.node_url(i)) as c:
            n += int(dict(c.pubsub_numsub(channel)).get(channel.encode(), 0))
    return n


async def run_cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """``rollq ARGS`` as a separate process (the real CLI, its own cluster client)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq.cli", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env={**os.environ, "ROLLQ_LOG_LEVEL": "WARNING"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"rollq {' '.join(args)} did not finish within {timeout}s") from None
    return proc.returncode, out.decode(), err.decode()


# ----------------------------------------------------------------------------------------
# the cluster itself
# ----------------------------------------------------------------------------------------
async def test_cluster_is_formed_and_queues_land_on_distinct_nodes(redis_cluster, cluster_client, node_queues):
    assert redis_cluster.formed_with in ("redis-cli", "valkey-cli", "python")
    assert RedisSettings.from_url(redis_cluster.url).cluster
    slots = redis_cluster.slot_map()
    assert sum(e - s + 1 for s, e, _ in slots) == 16384
    assert sorted({port for _, _, port in slots}) == sorted(redis_cluster.ports)
    assert [redis_cluster.node_of_queue(q) for q in node_queues] == [0, 1, 2]
    for i, q in enumerate(node_queues):
        node = cluster_client.get_node_from_key(QueueKeys(q).jobs)
        assert node.port == redis_cluster.ports[i]
        # every key of the queue hashes to the slot of its tag
        assert await cluster_client.cluster_keyslot(QueueKeys(q).results("p-x")) == slot_of_queue(q)


def test_cluster_formed_from_python_without_redis_cli():
    """The fixture's fallback (no redis-cli): ADDSLOTS + SET-CONFIG-EPOCH + MEET."""
    with LocalCluster(masters=3, use_cli=False) as cl:
        assert cl.formed_with == "python"
        assert sorted({p for _, _, p in cl.slot_map()}) == sorted(cl.ports)
        with redis.RedisCluster(host="127.0.0.1", port=cl.ports[2]) as rc:
            for q in cl.queues_on_every_node():
                rc.set(QueueKeys(q).stats, b"1")
                assert rc.get(QueueKeys(q).stats) == b"1"
        roots = [cl.data_dir, *(n.data_dir for n in cl.nodes)]
    assert not any(os.path.exists(r) for r in roots), "temp dirs left behind"


async def test_rollq_redis_cluster_command_starts_and_removes_a_cluster():
    """``rollq redis --cluster 3``: prints the URL of a working cluster; SIGTERM removes it all."""
    import signal

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq.cli", "redis", "--cluster", "3", "--json", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line, (await proc.stderr.read()).decode()[-2000:]
        info = json.loads(line)
        assert info["url"].startswith("redis+cluster://127.0.0.1:") and len(info["nodes"]) == 3
        c = connect(info["url"])
        try:
            await c.set(QueueKeys("anywhere").stats, b"1")
            assert len(c.get_primaries()) == 3
        finally:
            await c.aclose()
        with redis.Redis.from_url(info["nodes"][0]) as plain:
            data_dir = plain.config_get("dir")["dir"]
        assert os.path.isdir(data_dir)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not os.path.exists(os.path.dirname(data_dir)), "the cluster's data directory is left behind"
    for url in info["nodes"]:
        with pytest.raises(redis.ConnectionError):
            with redis.Redis.from_url(url, socket_connect_timeout=2) as plain:
                plain.ping()


# ----------------------------------------------------------------------------------------
# producer -> consumer -> results, on every node at once
# ----------------------------------------------------------------------------------------
async def test_submit_consume_exactly_once_on_every_node(redis_cluster, node_queues, make_producer, make_consumer, cluster_client):
    async def one(i: int, q: str) -> None:
        p = await make_producer(q, script_batch=40)  # 150 jobs: 4 script calls in one pipeline
        singles = [await p.submit(prompt_token_ids=[i, k], sampling={"max_tokens": 3}) for k in range(5)]
        many = await p.submit_many(
            [{"prompt_token_ids": [100 + k], "sampling": {"max_tokens": 2}, "id": f"job-{k}"} for k in range(150)]
        )
        again = await p.submit_many([{"prompt": "dup", "id": f"job-{k}"} for k in range(10)])  # idempotent
        assert all(h.duplicate for h in again)
        assert not any(h.duplicate for h in many + singles)
        c = make_consumer(q, consumer_id=f"node{i}-a", batch=32)
        c2 = make_consumer(q, consumer_id=f"node{i}-b", batch=32)
        make_consumer.start(c)
        make_consumer.start(c2)
        got = await collect(p, 155, timeout=60)
        assert len(got) == 155
        dup = {k: len(v) for k, v in got.items() if len(v) != 1}
        assert not dup, f"results delivered more than once: {dup}"
        for k in range(150):
            r = got[f"job-{k}"][0]
            assert r.ok and r.samples[0].token_ids == [100 + k, 100 + k]
        for k, h in enumerate(singles):
            assert got[h.id][0].samples[0].token_ids == [i, k, i]
        assert {r[0].replica for r in got.values()} <= {f"node{i}-a", f"node{i}-b"}
        await make_consumer.stop(c)
        await make_consumer.stop(c2)
        assert c.counters.completed + c2.counters.completed == 155
        assert c.counters.refused_duplicates == c2.counters.refused_duplicates == 0

    await asyncio.gather(*(one(i, q) for i, q in enumerate(node_queues)))
    for i, q in enumerate(node_queues):
        k = QueueKeys(q)
        st = {a.decode(): int(b) for a, b in (await cluster_client.hgetall(k.stats)).items()}
        assert st["submitted"] == 155 and st["completed"] == 155, st
        assert await cluster_client.xlen(k.jobs) == 0
        assert await cluster_client.hlen(k.ids) == 0
        # the queue's keys are on node i, and only there
        here = queue_keys_on(redis_cluster, i, q)
        assert k.jobs.encode() in here and k.stats.encode() in here
        for j in range(3):
            if j != i:
                assert queue_keys_on(redis_cluster, j, q) == []


async def test_reclaimed_job_runs_twice_but_is_delivered_once(redis_cluster, make_producer, make_consumer, cluster_client):
    q = redis_cluster.queue_on(1)
    k = QueueKeys(q)
    p = await make_producer(q)
    handles = await p.submit_many([{"prompt_token_ids": [j], "sampling": {"max_tokens": 1}} for j in range(6)])
    # A replica that took every job and died: it read them and never heartbeats.
    await cluster_client.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
    taken = await cluster_client.xreadgroup(GROUP, "dead-1", {k.jobs: ">"}, count=100)
    eids = [eid for eid, _ in taken[0][1]]
    assert len(eids) == 6
    c = make_consumer(q, consumer_id="alive-1")
    assert await make_consumer.burst(c) == 0
    rs = await p.gather(handles, timeout=10)
    assert all(r.ok and r.deliveries == 2 and r.replica == "alive-1" for r in rs)
    assert c.counters.reclaimed == 6
    # The dead replica wakes up and finishes its copies: every result is refused.
    rows = [(4, eid, "", 5, b"late", b"", "completed") for eid in eids]
    flags = await FINISH(
        cluster_client, [k.ids, k.stats, k.dlq, k.jobs, k.results(p.id)],
        [GROUP, 60_000, 1000, msgpack.packb(rows, use_bin_type=False)],
    )
    assert flags == [0] * 6
    async for extra in p.results(timeout=0.5):
        raise AssertionError(f"a second result reached the producer: {extra}")
    assert await cluster_client.xlen(k.jobs) == 0


async def test_a_long_job_keeps_its_lease_while_a_peer_watches(redis_cluster, make_producer, make_consumer):
    """Heartbeats renew the lease (and read cancel marks) while jobs run: a peer never takes
    over a long job of a live replica."""
    q = redis_cluster.queue_on(0)
    p = await make_producer(q)
    slow = make_consumer(q, engine=EchoEngine(delay_per_token=0.05), consumer_id="lj-slow")
    make_consumer.start(slow)
    h = await p.submit("long", sampling={"max_tokens": 60})  # 3 s: many heartbeats, lease 1 s
    await until(lambda: h.id in slow.jobs.by_job, 10, "the long job to start")
    peer = make_consumer(q, consumer_id="lj-peer")
    make_consumer.start(peer)
    r = await bounded(h.result(), 30, "the long job")
    assert r.ok and r.replica == "lj-slow" and r.deliveries == 1
    assert peer.counters.reclaimed == 0 and peer.counters.pulled == 0
    assert slow.counters.refused_duplicates == 0


# ----------------------------------------------------------------------------------------
# cancel, dead letters, targeting
# ----------------------------------------------------------------------------------------
async def test_cancel_queued_and_running_jobs_with_the_pubsub_hint(redis_cluster, make_producer, make_consumer, cluster_client):
    q = redis_cluster.queue_on(2)
    k = QueueKeys(q)
    p = await make_producer(q)
    engine = EchoEngine(delay_per_token=0.05)
    # heartbeats (which also check cancel marks) 30 s apart: only the pub/sub hint cancels fast
    c = make_consumer(q, engine=engine, consumer_id="cx-a", heartbeat_interval=30.0, lease_ttl=60.0)
    hints: list[tuple[str, str]] = []
    c.add_control_handler(lambda verb, arg: hints.append((verb, arg)))
    make_consumer.start(c)
    await until(lambda: cluster_client.exists(k.heartbeat("cx-a")), 10, "the consumer to register")
    await until(lambda: subscribers(redis_cluster, k.control) >= 1, 10, "the consumer to subscribe to its control channel")
    queued = await p.submit("never runs", replica="nobody-serves-this", sampling={"max_tokens": 2})
    running = await p.submit("long", sampling={"max_tokens": 400})  # 20 s unless cancelled
    await until(lambda: running.id in c.jobs.by_job, 10, "the long job to start")
    assert await queued.cancel()
    assert await cluster_client.xlen(k.replica_jobs("nobody-serves-this")) == 0
    with pytest.raises(JobCancelled):
        await bounded(queued.result(), 5, "the cancelled queued job")
    assert await running.cancel()
    with pytest.raises(JobCancelled):
        await bounded(running.result(), 5, "the cancelled running job")
    # the hint went through cluster pub/sub (the heartbeat, which also checks marks, is 30 s away)
    await until(lambda: ("cancel", running.id) in hints, 10, "the cancel hint on the control channel")
    await until(lambda: c.counters.failed == 1 and not c.jobs.running, 10, "the running job to be aborted")
    st = {a.decode(): int(b) for a, b in (await cluster_client.hgetall(k.stats)).items()}
    assert st.get("cancelled") == 1 and st.get("failed") == 1 and not st.get("completed")
    assert ("cancel", queued.id) not in hints  # removed from its stream: no replica needed telling


async def test_malformed_entries_are_dead_lettered_and_later_jobs_served(redis_cluster, make_producer, make_consumer, cluster_client):
    q = redis_cluster.queue_on(0)
    k = QueueKeys(q)
    p = await make_producer(q)
    await cluster_client.xadd(k.jobs, {"d": b"\x93not-a-job"})
    await cluster_client.xadd(k.jobs, {"x": b"no payload field"})
    h = await p.submit("fine", sampling={"max_tokens": 2})
    c = make_consumer(q, consumer_id="dl-a")
    assert await make_consumer.burst(c) == 0
    r = await bounded(h.result(), 5, "the valid job")
    assert r.ok and r.samples[0].token_ids == [102, 105]
    dead = await dlq_list(cluster_client, k)
    assert len(dead) == 2
    reasons = " | ".join(d.reason for d in dead)
    assert "no 'd' field" in reasons
    assert all(not d.requeueable for d in dead)
    assert c.counters.dead_lettered == 2
    # the CLI reads the same through its own cluster client
    rc, out, err = await run_cli("dlq", "list", "--url", redis_cluster.url, "--queue", q, "--json")
    assert rc == 0, err
    listed = json.loads(out)
    assert sorted(d["entry_id"] for d in listed) == sorted(d.entry_id for d in dead)
    assert await dlq_requeue(cluster_client, k) == (0, 2)  # not valid jobs: they stay


async def test_dead_lettered_job_is_requeued_through_the_cluster(redis_cluster, make_producer, make_consumer, cluster_client):
    q = redis_cluster.queue_on(1)
    k = QueueKeys(q)
    p = await make_producer(q)
    h = await p.submit("ok", sampling={"max_tokens": 2}, id="rq-1")
    # delivered max_deliveries times, to replicas that all died: dead-lettered on the next delivery
    await cluster_client.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
    taken = await cluster_client.xreadgroup(GROUP, "dead-0", {k.jobs: ">"}, count=1)
    eid = taken[0][1][0][0]
    for n in (1, 2):  # each XCLAIM counts one more delivery
        await cluster_client.xclaim(k.jobs, GROUP, f"dead-{n}", 0, [eid])
    c = make_consumer(q, consumer_id="rq-a", max_deliveries=3)
    assert await make_consumer.burst(c) == 0
    r = await bounded(h.result(raise_error=False), 5, "the dead-lettered job's error")
    assert r.error is not None and r.error.type == "DeadLettered"
    assert (await dlq_list(cluster_client, k))[0].requeueable
    assert await dlq_requeue(cluster_client, k) == (1, 0)
    assert await cluster_client.xlen(k.dlq) == 0
    assert await cluster_client.xlen(k.jobs) == 1


async def test_jobs_targeted_at_a_replica_run_there(redis_cluster, node_queues, make_producer, make_consumer):
    for i, q in enumerate(node_queues):
        p = await make_producer(q)
        hs = await p.submit_many(
            [{"prompt": f"t{j}", "replica": ("rep-a" if j % 3 else "rep-b"), "sampling": {"max_tokens": 1}} for j in range(30)]
            + [{"prompt": f"u{j}", "sampling": {"max_tokens": 1}} for j in range(10)]
        )
        ca, cb = make_consumer(q, consumer_id="rep-a"), make_consumer(q, consumer_id="rep-b")
        make_consumer.start(ca)
        make_consumer.start(cb)
        rs = await p.gather(hs, timeout=30)
        for j, r in enumerate(rs[:30]):
            assert r.ok and r.replica == ("rep-a" if j % 3 else "rep-b"), (i, j, r.replica)
        assert all(r.ok and r.replica in ("rep-a", "rep-b") for r in rs[30:])
        await make_consumer.stop(ca)
        await make_consumer.stop(cb)


# ----------------------------------------------------------------------------------------
# status
# ----------------------------------------------------------------------------------------
async def test_rollq_status_and_check_through_the_cluster_url(redis_cluster, make_producer, make_consumer, cluster_client):
    q = redis_cluster.queue_on(2)
    k = QueueKeys(q)
    p = await make_producer(q)
    await p.submit_many([{"prompt": "a", "sampling": {"max_tokens": 1}}] * 4)
    await p.submit("b", replica="st-a", sampling={"max_tokens": 1})
    await p.submit("c", min_version=1, sampling={"max_tokens": 1})  # held by a replica at version 0
    rc, out, err = await run_cli("status", "--url", redis_cluster.url, "--queue", q, "--json")
    assert rc == 0, err
    st = json.loads(out)
    # a targeted stream counts once its replica is in the registry (status never scans for keys)
    assert (st["depth"], st["in_flight"], st["submitted"], st["completed"]) == (5, 0, 6, 0)
    assert st["replicas"] == []

    c = make_consumer(q, consumer_id="st-a")
    make_consumer.start(c)
    await until(lambda: c.counters.completed == 5 and len(c.versions.waiting) == 1, 20, "five jobs done, one held")
    rc, out, err = await run_cli("status", "--url", redis_cluster.url, "--queue", q, "--json")
    assert rc == 0, err
    st = json.loads(out)
    assert (st["depth"], st["in_flight"], st["completed"]) == (0, 1, 5)
    assert [r["id"] for r in st["replicas"]] == ["st-a"] and st["replicas"][0]["alive"]
    rc, _, err = await run_cli("check", "--url", redis_cluster.url, "--queue", q, "--id", "st-a")
    assert rc == 0, err
    rc, out, err = await run_cli("status", "--url", redis_cluster.url, "--queue", q)  # the rich view
    assert rc == 0 and "st-a" in out, err
    c.version = 1
    c.release_held()
    await until(lambda: c.counters.completed == 6, 20, "the held job")
    await make_consumer.stop(c)
    snap = await queue_status(cluster_client, k)
    assert (snap.depth, snap.in_flight, snap.completed, snap.replicas) == (0, 0, 6, [])
    rc, _, _ = await run_cli("check", "--url", redis_cluster.url, "--queue", q, "--id", "st-a")
    assert rc == 1  # its lease is gone


async def test_cli_submit_and_consume_through_the_cluster_url(redis_cluster, tmp_path):
    q = redis_cluster.queue_on(1)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"c{j}", "prompt_token_ids": [j, j + 1], "sampling": {"max_tokens": 2}}) + "\n" for j in range(5)))
    rc, out, err = await run_cli("submit", "--url", redis_cluster.url, "--queue", q, str(jobs))
    assert rc == 0, err
    assert [json.loads(line)["id"] for line in out.splitlines()] == [f"c{j}" for j in range(5)]
    rc, _, err = await run_cli("consume", "--url", redis_cluster.url, "--queue", q, "--engine", "echo", "--burst", "--id", "cli-r")
    assert rc == 0, err
    client = connect(redis_cluster.url)
    try:
        st = await queue_status(client, QueueKeys(q))
    finally:
        await client.aclose()
    assert (st.depth, st.in_flight, st.completed) == (0, 0, 5)


async def test_dashboard_sampler_reads_a_cluster_queue(redis_cluster, node_queues, make_producer):
    from rollq.dashboard.sampler import Sampler

    for q in node_queues:
        p = await make_producer(q)
        await p.submit_many([{"prompt": "s", "sampling": {"max_tokens": 1}}] * 3)
    async with Sampler(redis_cluster.url, node_queues) as s:
        await s.sample_all()
        for q in node_queues:
            info = s.sampler_info(q)
            assert info["ok"], info
            assert s.document(q)["queue"]["waiting"] == 3


# ----------------------------------------------------------------------------------------
# staleness bound and policy versions
# ----------------------------------------------------------------------------------------
async def test_staleness_bound_and_versions_through_the_cluster(redis_cluster, node_queues, make_producer, make_consumer, cluster_client):
    for i, q in enumerate(node_queues):
        k = QueueKeys(q)
        p = await make_producer(q, block_when_full=False)
        await p.set_staleness_bound(max_lag=0, batch=2)  # (0 + version + 1) * 2 jobs in all
        first = await p.submit_many([{"prompt": "a", "sampling": {"max_tokens": 1}}] * 2)
        with pytest.raises(StalenessBound):
            await p.submit("over the bound")
        c = make_consumer(q, consumer_id=f"v-{i}")
        hints: list[tuple[str, str]] = []
        c.add_control_handler(lambda verb, arg: hints.append((verb, arg)))
        make_consumer.start(c)
        await p.gather(first, timeout=10)
        await until(lambda: subscribers(redis_cluster, k.control) >= 1, 10, "the consumer to subscribe to its control channel")

        rec = lambda v: VersionRecord(version=v, transport="memmap", checksum=f"c{v}", num_tensors=1, nbytes=4)  # noqa: E731
        assert await commit_version(cluster_client, k, rec(1))
        assert not await commit_version(cluster_client, k, rec(1))
        assert not await commit_version(cluster_client, k, rec(0))
        got = await read_version(cluster_client, k)
        assert got is not None and (got.version, got.checksum) == (1, "c1")
        assert [v["version"] for v in await version_log(cluster_client, k)] == [1]
        await until(lambda: ("version", "1") in hints, 10, "the version hint through cluster pub/sub")
        # version 1 admits (0 + 1 + 1) * 2 = 4 in all: two more
        more = await p.submit_many([{"prompt": "b", "sampling": {"max_tokens": 1}, "min_version": 1}] * 2)
        with pytest.raises(StalenessBound):
            await p.submit("over again")
        c.version = 1
        c.release_held()
        rs = await p.gather(more, timeout=10)
        assert all(r.ok and r.policy_version == (1, 1) for r in rs)
        assert (await queue_status(cluster_client, k)).version == 1
        await make_consumer.stop(c)


async def test_memmap_weight_publish_and_follow_through_the_cluster(redis_cluster, tmp_path, make_consumer):
    torch = pytest.importorskip("torch")
    from rollq.producer.client import Producer
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower, WeightPublisher

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    q = redis_cluster.queue_on(2)
    root = str(tmp_path / "w")
    engine = FakeWorkerEngine(model)
    c = make_consumer(q, engine=engine, consumer_id="mm-a")
    follower = WeightFollower(c, WeightSyncSettings(root=root, reconcile_interval=0.3))
    await follower.start()
    make_consumer.start(c)
    try:
        async with Producer(redis_cluster.url, q) as p:
            rec = await p.publish_weights({"weight": torch.full((2, 4), 3.0), "bias": torch.zeros(2)}, root=root)
            assert rec.version == 1
            await until(lambda: c.version == 1, 20, "the replica to load version 1")
            w = engine.workers[0].model_runner.model.module.weight
            assert float(w.detach()[0, 0]) == 3.0
            r = await bounded(await p.submit("after", sampling={"max_tokens": 1}), 10, "a job after the update")
            assert r.policy_version == (1, 1)
            pub = WeightPublisher(redis_cluster.url, q, root=root)
            assert await pub.current_version() == 1
            await pub.close()
    finally:
        await follower.stop()


async def test_gloo_broadcast_acks_through_the_cluster(redis_cluster, tmp_path):
    """Workers acknowledge staged broadcast versions in Redis themselves: on a cluster they must
    reach the node of the queue's slot, not the seed node of the URL."""
    torch = pytest.importorskip("torch")
    from rollq.consumer.loop import Consumer
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower, WeightPublisher
    from rollq.weightsync.nccl import BroadcastSender

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    q = redis_cluster.queue_on(1)  # not the seed node's slots
    assert redis_cluster.node_of_queue(q) != 0
    root = str(tmp_path / "w")
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=20, bucket_bytes=1024)
    pub = WeightPublisher(redis_cluster.url, q, root=root, sender=sender)
    engine = FakeWorkerEngine(model)
    consumer = Consumer(engine, redis_cluster.url, q)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True))
    await follower.start()
    try:
        rec = await asyncio.wait_for(pub.publish_weights({"weight": torch.full((2, 4), 5.0), "bias": torch.ones(2)}, transport="nccl"), 120)
        assert rec.transport == "gloo" and not rec.timings.get("nccl_failed"), rec
        await until(lambda: consumer.version == rec.version, 20, "the replica to swap in the broadcast version")
        assert float(engine.workers[0].model_runner.model.module.weight.detach()[0, 0]) == 5.0
    finally:
        await follower.stop()
        await pub.close()


# ----------------------------------------------------------------------------------------
# key hygiene (runs last in this module: it inspects what the tests above left)
# ----------------------------------------------------------------------------------------
async def test_every_key_on_every_node_carries_its_queue_tag(redis_cluster, node_queues, make_producer, make_consumer):
    for q in node_queues:  # at least one full round trip of our own
        p = await make_producer(q)
        hs = await p.submit_many([{"prompt": "k", "sampling": {"max_tokens": 1}, "id": "k1"}, {"prompt": "t", "replica": "kk"}])
        c = make_consumer(q, consumer_id="kk")
        assert await make_consumer.burst(c) == 0
        await p.gather(hs, timeout=10)
    sharded = f"{node_queues[0]}-sh"  # a queue of 3 shards: its shards' keys carry {queue~i}
    p = await make_producer(sharded, shards=3)
    hs = await p.submit_many([{"prompt": f"s{j}", "sampling": {"max_tokens": 1}, "id": f"s{j}"} for j in range(12)])
    c = make_consumer(sharded, consumer_id="ks", shards=3)
    assert await make_consumer.burst(c) == 0
    await p.gather(hs, timeout=10)
    seen, shard_tags = 0, set()
    for i in range(len(redis_cluster.nodes)):
        for key in node_keys(redis_cluster, i):
            if key == QUEUES.encode():  # the registry of queue names: the one global key
                continue
            m = KEY_RE.match(key)
            assert m, f"key {key!r} on node {i} is not rollq:{{queue}}:... or rollq:{{queue~shard}}:..."
            tag = b"{" + m.group(1) + (m.group(2) or b"") + b"}"
            assert redis_cluster.node_of_slot(key_slot(tag)) == i, f"{key!r} is on node {i}, its tag's slot is elsewhere"
            seen += 1
            if m.group(2):
                shard_tags.add(tag)
    assert seen >= 3
    assert len(shard_tags) >= 2, f"the sharded queue's shards 1 and 2 left no keys: {shard_tags}"
