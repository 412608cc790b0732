"""Faults: bad input, dead and dying consumers, poison jobs, Redis restarts, SIGTERM drains.

Consumers that must die for real run as processes (tests/helpers/consumer_proc.py) and are
killed with SIGKILL / SIGTERM; leases are short so that a dead replica's jobs come back in
about two seconds.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rollq.connection import connect
from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.errors import DeadLettered, JobRejected
from rollq.keys import GROUP, QueueKeys
from rollq.protocol import SamplingParams, decode_dead_letter, decode_job, encode_job
from tests.helpers import bounded, collect, pending_of, until

pytestmark = pytest.mark.chaos

#: Lease settings of consumer processes: a dead one is noticed within ~2.5 s.
LEASE = dict(lease_ttl=2, heartbeat=0.5, reclaim=0.5)


async def dead_letters(client, queue: str) -> list:
    return [decode_dead_letter(f[b"d"]) for _, f in await client.xrange(QueueKeys(queue).dlq)]


async def stats(client, queue: str) -> dict[str, int]:
    raw = await client.hgetall(QueueKeys(queue).stats)
    return {k.decode(): int(v) for k, v in raw.items()}


def assert_exactly_once(got: dict[str, list], ids: list[str]) -> None:
    dups = {i: len(rs) for i, rs in got.items() if len(rs) > 1}
    assert not dups, f"results delivered more than once: {dups}"
    missing = set(ids) - set(got)
    assert not missing, f"{len(missing)} jobs never returned a result"
    assert set(got) == set(ids)
    bad = [rs[0] for rs in got.values() if not rs[0].ok]
    assert not bad, f"{len(bad)} jobs failed, e.g. {bad[0].error}"


# ----------------------------------------------------------------------------------------
# (a) malformed entries
# ----------------------------------------------------------------------------------------
async def test_malformed_entries_are_dead_lettered(queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    before = await p.submit_many([{"prompt": f"before {i}", "sampling": {"max_tokens": 2}} for i in range(5)])

    bad_version = p.build_job(prompt="from the future", id="bad-version")
    bad_version.v = 99
    bad_sampling = p.build_job(prompt="hot", id="bad-sampling")
    bad_sampling.sampling = SamplingParams(temperature=-1.0)  # the struct does not validate: a buggy writer
    raw = {
        "missing-field": {b"x": b"1"},
        "garbage": {b"d": b"\xc1\xffnot msgpack at all"},
        "wrong-shape": {b"d": msgspec.msgpack.encode({"id": "zz", "prompt": "hi"})},
        "bad-version": {b"d": encode_job(bad_version)},
        "bad-sampling": {b"d": encode_job(bad_sampling)},
    }
    for name, fields in raw.items():
        pipe = redis_client.pipeline(transaction=True)
        if name.startswith("bad-"):  # as submit.lua would: the id is known as queued
            pipe.hset(k.ids, name, p.id)  # the owner: this producer
        pipe.xadd(k.jobs, fields)
        await pipe.execute()
    # the submitter holds handles for the two jobs it can be told about
    h_version = await p.submit("x", id="bad-version")
    h_sampling = await p.submit("x", id="bad-sampling")
    assert h_version.duplicate and h_sampling.duplicate
    after = await p.submit_many([{"prompt": f"after {i}", "sampling": {"max_tokens": 2}} for i in range(5)])

    c = make_consumer(queue, consumer_id="survivor")
    assert await make_consumer.burst(c) == 0

    # valid jobs before and after were all served by the same consumer
    results = await p.gather(before + after, timeout=5)
    assert all(r.ok and r.replica == "survivor" for r in results)
    # the submitter of the decodable-but-invalid jobs got a clear error
    with pytest.raises(JobRejected, match="schema version 99"):
        await bounded(h_version.result(), 5, "the bad-version handle")
    with pytest.raises(JobRejected, match="temperature"):
        await bounded(h_sampling.result(), 5, "the bad-sampling handle")

    dl = await dead_letters(redis_client, queue)
    assert len(dl) == 5, dl
    by_reason = {}
    for d in dl:
        assert d.consumer == "survivor" and d.source == k.jobs and d.deliveries == 1 and d.at > 0
        if "no 'd' field" in d.reason:
            by_reason["missing-field"] = d
        elif "not valid msgpack" in d.reason:
            by_reason["garbage"] = d
        elif "malformed job" in d.reason:
            by_reason["wrong-shape"] = d
        elif "schema version 99" in d.reason:
            by_reason["bad-version"] = d
        elif "temperature" in d.reason:
            by_reason["bad-sampling"] = d
    assert set(by_reason) == set(raw), [d.reason for d in dl]
    assert by_reason["missing-field"].error_type == "DeadLettered"
    for name in ("garbage", "wrong-shape", "bad-version", "bad-sampling"):
        assert by_reason[name].error_type == "JobRejected"
        assert by_reason[name].payload == raw[name][b"d"], "the dead letter keeps the entry untouched"
    assert by_reason["bad-version"].job_id == "bad-version"
    assert by_reason["bad-sampling"].job_id == "bad-sampling"
    assert by_reason["garbage"].job_id is None and by_reason["wrong-shape"].job_id is None

    assert (c.counters.completed, c.counters.failed, c.counters.dead_lettered) == (10, 5, 5)
    st = await stats(redis_client, queue)
    assert (st["completed"], st["failed"], st["dead_lettered"]) == (10, 5, 5)
    assert await redis_client.xlen(k.jobs) == 0
    assert not await redis_client.exists(k.ids)


async def test_prompt_longer_than_the_context_is_rejected(queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    h_ok1 = await p.submit("short", sampling={"max_tokens": 4})
    h_long = await p.submit(prompt_token_ids=list(range(40)), sampling={"max_tokens": 4}, meta="m")
    h_ok2 = await p.submit("short too", sampling={"max_tokens": 4})
    c = make_consumer(queue, engine=EchoEngine(max_model_len=32))
    await make_consumer.burst(c)
    with pytest.raises(JobRejected, match="context"):
        await bounded(h_long.result(), 5, "the over-long job")
    r = await h_long.result(raise_error=False)
    assert r.meta == "m" and r.replica == c.id
    assert all(r.ok for r in await p.gather([h_ok1, h_ok2], timeout=5))
    (d,) = await dead_letters(redis_client, queue)
    assert d.job_id == h_long.id and d.error_type == "JobRejected" and "context" in d.reason
    assert decode_job(d.payload).prompt_token_ids == list(range(40))


async def test_consumer_enforces_its_prompt_size_limit(queue, make_producer, make_consumer, redis_client):
    """ConsumerSettings.max_prompt_bytes protects the replica from a producer with a larger limit."""
    p = await make_producer(queue)  # default limit: 4 MiB
    h_big = await p.submit("x" * 100, sampling={"max_tokens": 1})
    h_ok = await p.submit("x" * 10, sampling={"max_tokens": 1})
    c = make_consumer(queue, max_prompt_bytes=64)
    await make_consumer.burst(c)
    assert (await bounded(h_ok.result(), 5, "the small job")).ok
    with pytest.raises(JobRejected, match="64 bytes"):
        await bounded(h_big.result(), 5, "the oversized job")
    (d,) = await dead_letters(redis_client, queue)
    assert d.job_id == h_big.id


# ----------------------------------------------------------------------------------------
# (b) a consumer process dies mid-job
# ----------------------------------------------------------------------------------------
async def test_sigkilled_consumer_jobs_come_back_exactly_once(queue, redis_url, make_producer, spawn, redis_client):
    k = QueueKeys(queue)
    lease = LEASE
    victim = spawn(redis_url, queue, "victim", 10, max_inflight=20, **lease)
    survivor = spawn(redis_url, queue, "survivor", 10, max_inflight=5, **lease)
    await asyncio.gather(victim.ready(), survivor.ready())
    p = await make_producer(queue)
    # 0.1 s jobs; the survivor runs 5 at a time, so alone it needs ~5 s for the backlog:
    # well over a lease, so "came back" cannot mean "waited for the backlog to drain"
    n = 300
    handles = await p.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 10}} for i in range(n)])

    await until(lambda: p.counters["results"] >= 30, 10, "the first results")
    await until(
        lambda: pending_of(redis_client, k.jobs, "victim"), 5, "the victim to hold jobs", interval=0.005
    )
    victim.kill()
    t_kill = time.monotonic()
    held = {e["message_id"] for e in await pending_of(redis_client, k.jobs, "victim")}
    assert held, "the victim held no jobs when it was killed"
    held_ids = {decode_job(f[b"d"]).id for eid in held for _, f in await redis_client.xrange(k.jobs, eid, eid)}
    assert len(held_ids) == len(held)

    got: dict[str, list] = {}

    async def take() -> None:
        async for r in p.results():
            got.setdefault(r.id, []).append(r)
            if held_ids <= set(got):
                return

    await bounded(take(), 30, "the dead consumer's jobs to complete elsewhere")
    back_after = time.monotonic() - t_kill
    # lease expiry + one reclaim round + one 0.1 s job, with room for a loaded machine
    limit = lease["lease_ttl"] + 2 * lease["reclaim"] + 1.2
    assert back_after < limit, f"the dead consumer's jobs completed {back_after:.1f}s after the kill (limit {limit}s)"

    rest = await collect(p, n - len(got), timeout=30, settle=0.5)
    for i, rs in rest.items():
        got.setdefault(i, []).extend(rs)
    assert_exactly_once(got, [h.id for h in handles])
    assert p.counters["results"] == n, "a duplicate result reached the producer"
    redelivered = {i for i, rs in got.items() if rs[0].deliveries > 1}
    assert redelivered == held_ids
    assert all(got[i][0].replica == "survivor" and got[i][0].deliveries == 2 for i in redelivered)
    assert (await stats(redis_client, queue))["completed"] == n
    assert await redis_client.xlen(k.jobs) == 0


async def test_consumer_restarted_under_the_same_id_recovers_its_jobs(queue, redis_url, make_producer, spawn, redis_client):
    """A replica with a stable name (systemd unit, StatefulSet pod) that crashes and comes back
    before its lease expires must run the jobs its previous incarnation held: nobody else
    will, since its lease is alive again."""
    k = QueueKeys(queue)
    first = spawn(redis_url, queue, "stable", 50, max_inflight=5, **LEASE)
    await first.ready()
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 10}} for i in range(5)])  # 0.5 s

    async def holds_all() -> bool:
        return len(await pending_of(redis_client, k.jobs, "stable")) == 5

    await until(holds_all, 5, "the first incarnation to take the jobs")
    first.kill()
    second = spawn(redis_url, queue, "stable", 50, max_inflight=5, **LEASE)
    await second.ready()
    got = await collect(p, 5, timeout=3 * LEASE["lease_ttl"], settle=0.3)
    assert_exactly_once(got, [h.id for h in handles])
    assert all(rs[0].replica == "stable" for rs in got.values())


# ----------------------------------------------------------------------------------------
# (c) a long job on a live consumer is never reclaimed
# ----------------------------------------------------------------------------------------
async def test_long_job_on_live_consumer_is_not_reclaimed(queue, make_producer, make_consumer, redis_client):
    lease = dict(lease_ttl=0.8, heartbeat_interval=0.2, reclaim_interval=0.2)
    busy_engine = EchoEngine(delay_per_token=0.1)
    busy = make_consumer(queue, engine=busy_engine, consumer_id="busy", **lease)
    make_consumer.start(busy)
    p = await make_producer(queue)
    h = await p.submit("long", sampling={"max_tokens": 25})  # 2.5 s: more than 3 leases
    await until(lambda: busy_engine.stats().running == 1, 5, "the long job to start")
    idle = make_consumer(queue, engine=EchoEngine(delay_per_token=0.1), consumer_id="idle", **lease)
    make_consumer.start(idle)
    t0 = time.monotonic()
    r = await bounded(h.result(), 10, "the long job")
    assert time.monotonic() - t0 > 3 * lease["lease_ttl"] - 0.3
    assert r.ok and r.replica == "busy" and r.deliveries == 1
    assert idle.counters.reclaimed == 0 and idle.counters.pulled == 0
    assert busy.counters.refused_duplicates == 0
    assert [x async for x in p.results(timeout=0.5)] == []
    assert p.counters["results"] == 1
    assert (await stats(redis_client, queue))["completed"] == 1


# ----------------------------------------------------------------------------------------
# (d) poison: the job's consumer dies every time
# ----------------------------------------------------------------------------------------
async def test_job_whose_consumers_keep_dying_is_dead_lettered(queue, redis_url, make_producer, make_consumer, spawn, redis_client):
    k = QueueKeys(queue)
    lease = dict(lease_ttl=1, heartbeat=0.25, reclaim=0.25)
    p = await make_producer(queue)
    h = await p.submit("poison", sampling={"max_tokens": 100}, meta="poison")  # 10 s: never finishes here

    async def owner() -> tuple[str, int] | None:
        pend = await redis_client.xpending_range(k.jobs, GROUP, min="-", max="+", count=10)
        if len(pend) != 1:
            return None
        e = pend[0]
        name = e["consumer"].decode() if isinstance(e["consumer"], bytes) else e["consumer"]
        return name, e["times_delivered"]

    for n, name in enumerate(("doomed-1", "doomed-2"), start=1):
        proc = spawn(redis_url, queue, name, 100, max_deliveries=2, **lease)
        await proc.ready()
        got = await until(
            lambda: owner_is(owner, name), 8, f"{name} to take the poison job", interval=0.02
        )
        assert got == (name, n)
        proc.kill()

    h_ok = await p.submit("fine", sampling={"max_tokens": 1})
    c = make_consumer(queue, consumer_id="last", max_deliveries=2, lease_ttl=1, heartbeat_interval=0.25, reclaim_interval=0.25)
    make_consumer.start(c)
    with pytest.raises(DeadLettered, match="max_deliveries=2"):
        await bounded(h.result(), 8, "the poison job's handle")
    assert (await bounded(h_ok.result(), 5, "a valid job on the last consumer")).replica == "last"
    (d,) = await dead_letters(redis_client, queue)
    assert d.job_id == h.id and d.error_type == "DeadLettered" and d.deliveries == 3 and d.consumer == "last"
    assert decode_job(d.payload).meta == "poison"
    await until(lambda: c.counters.dead_lettered == 1, 2, "the dead letter to be counted")
    assert await redis_client.xlen(k.jobs) == 0
    assert not await redis_client.hexists(k.ids, h.id)


async def owner_is(owner, name):
    o = await owner()
    return o if o and o[0] == name else None


# ----------------------------------------------------------------------------------------
# (e) Redis restarts
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hard", [False, True], ids=["graceful", "sigkill"])
async def test_redis_restart_mid_run(queue, fresh_redis, make_producer, make_consumer, hard):
    url = fresh_redis.url
    settings = dict(url=url, max_inflight=20, initial_inflight=20, lease_ttl=2.0)
    consumers = [
        make_consumer(queue, engine=EchoEngine(delay_per_token=0.01), consumer_id=f"c{i}", **settings) for i in range(2)
    ]
    for c in consumers:
        make_consumer.start(c)
    p = await make_producer(queue, url=url)
    got: dict[str, list] = {}

    async def collector():
        async for r in p.results():
            got.setdefault(r.id, []).append(r)

    task = asyncio.create_task(collector())
    try:
        # 1. consumers (and the producer's result reader) ride through the restart
        ids = [h.id for h in await p.submit_many([{"prompt": f"a{i}", "sampling": {"max_tokens": 5}} for i in range(300)])]
        await until(lambda: len(got) >= 60, 10, "results before the restart")
        pid = fresh_redis.proc.pid
        await asyncio.to_thread(fresh_redis.restart, hard=hard)
        assert fresh_redis.proc.pid != pid
        assert len(got) < 300, "the restart came too late to be mid-run"
        await until(lambda: len(got) >= 300, 15, "every job submitted before the restart")
        await asyncio.sleep(0.5)  # late duplicates would arrive now
        assert_exactly_once(got, ids)
        assert all(not c._stopping.is_set() for c in consumers), "a consumer stopped"
        # 2. the producer keeps working: submitting after the restart just works
        ids += [h.id for h in await p.submit_many([{"prompt": f"b{i}", "sampling": {"max_tokens": 5}} for i in range(100)])]
        await until(lambda: len(got) >= 400, 15, "every job submitted after the restart")
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
    assert_exactly_once(got, ids)
    assert p.counters["results"] == 400
    # both consumers still serve
    more = await p.submit_many([{"prompt": f"c{i}", "replica": f"c{i % 2}", "sampling": {"max_tokens": 1}} for i in range(10)])
    rs = await p.gather(more, timeout=10)
    assert {r.replica for r in rs} == {"c0", "c1"}
    client = connect(url)
    try:
        assert (await stats(client, queue))["completed"] == 410
        assert await client.xlen(QueueKeys(queue).jobs) == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize("hard", [False, True], ids=["graceful", "sigkill"])
async def test_producer_submits_after_redis_restart(queue, fresh_redis, make_producer, make_consumer, hard):
    """Redis is back: the next submit must work, not fail on a connection the restart closed."""
    p = await make_producer(queue, url=fresh_redis.url)
    h1 = await p.submit("before", sampling={"max_tokens": 1})
    await asyncio.to_thread(fresh_redis.restart, hard=hard)
    h2 = await bounded(p.submit("after", sampling={"max_tokens": 1}), 10, "a submit after the restart")
    assert not h2.duplicate
    await make_consumer.burst(make_consumer(queue, url=fresh_redis.url))
    r1, r2 = await p.gather([h1, h2], timeout=10)
    assert r1.ok and r2.ok


async def test_entries_delivered_but_never_received_are_recovered(queue, make_producer, make_consumer, redis_client):
    """The state a Redis restart (or a dropped connection) leaves when it loses an XREADGROUP
    reply: the entries are pending for a live consumer that never saw them. Its lease is
    renewed, so no peer reclaims them: the consumer itself must notice."""
    k = QueueKeys(queue)
    c = make_consumer(queue, consumer_id="c0", block=0.05)
    make_consumer.start(c)
    await until(lambda: c.state == "serving", 5, "the consumer to serve")
    c.intake_gate.clear()  # hold the pull loop (as a weight update does)
    await asyncio.sleep(0.3)  # let a read in flight return
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 1}} for i in range(3)])
    # Redis ran this XREADGROUP for c0, but the reply never reached it:
    resp = await redis_client.xreadgroup(GROUP, "c0", {k.jobs: ">"}, count=10)
    assert resp and len(resp[0][1]) == 3, "precondition: the consumer must not have pulled the jobs itself"
    c.intake_gate.set()
    h_next = await p.submit("submitted afterwards", sampling={"max_tokens": 1})
    assert (await bounded(h_next.result(), 5, "a job submitted afterwards")).ok
    results = await bounded(p.gather(handles), 3 * c.settings.lease_ttl + 2, "the jobs whose delivery was lost")
    assert all(r.ok and r.replica == "c0" for r in results)


async def test_job_taken_back_from_a_dead_peer_runs_again(queue, make_producer, make_consumer, redis_client):
    """A replica presumed dead (its lease lapsed in a stall) loses a job to a peer, which then
    dies itself: when the job comes back to the first replica, it must run again there."""
    k = QueueKeys(queue)
    engine = EchoEngine(delay_per_token=0.05)
    a = make_consumer(queue, engine=engine, consumer_id="a", lease_ttl=1.0, heartbeat_interval=0.2, reclaim_interval=0.2)
    make_consumer.start(a)
    p = await make_producer(queue)
    h = await p.submit("long", sampling={"max_tokens": 30})  # 1.5 s
    await until(lambda: engine.stats().running == 1, 5, "the job to start on a")
    (entry,) = await pending_of(redis_client, k.jobs, "a")
    # a's lease lapses (a stall) and a live peer that took a for dead claims the job
    pipe = redis_client.pipeline(transaction=True)
    pipe.delete(k.heartbeat("a"))
    pipe.set(k.heartbeat("peer"), b"1", px=60_000)
    pipe.xclaim(k.jobs, GROUP, "peer", 0, [entry["message_id"]])
    await pipe.execute()
    # a notices its lease had lapsed and drops its copy of what is owned elsewhere now
    await until(lambda: engine.stats().running == 0, 5, "a to drop the copy a peer owns now")
    # ... then the peer dies: the job comes back to a, which must run it again
    await redis_client.delete(k.heartbeat("peer"))
    r = await bounded(h.result(), 8, "the job after it came back from the dead peer")
    assert r.ok and r.replica == "a"
    await until(lambda: a.counters.completed == 1, 5, "a to count the job")
    assert [x async for x in p.results(timeout=0.5)] == []
    assert p.counters["results"] == 1
    assert await redis_client.xlen(k.jobs) == 0


class CountingEcho(EchoEngine):
    """EchoEngine that counts how often each job is handed to it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.submits: dict[str, int] = {}

    def submit(self, request_id, job, done):
        self.submits[job.id] = self.submits.get(job.id, 0) + 1
        super().submit(request_id, job, done)


async def test_slow_read_reply_is_not_started_twice(queue, make_producer, make_consumer, monkeypatch):
    """Recovering "delivered but never received" entries must not race a read whose reply is
    merely late (a busy event loop, a slow link): each entry starts once per consumer."""
    real_connect = Consumer._connect
    late_reply_handled = asyncio.Event()

    async def connect(self):
        await real_connect(self)
        read = self._ctx.block_redis.xreadgroup

        async def late_read(*a, **kw):
            resp = await read(*a, **kw)
            if resp:
                await asyncio.sleep(2.5)  # the reply is in; the loop gets to it late
                asyncio.get_running_loop().call_soon(late_reply_handled.set)  # after the caller used it
            return resp

        self._ctx.block_redis.xreadgroup = late_read

    monkeypatch.setattr(Consumer, "_connect", connect)
    engine = CountingEcho()
    c = make_consumer(queue, engine=engine, consumer_id="late", reclaim_interval=0.1, heartbeat_interval=0.1)
    make_consumer.start(c)
    await until(lambda: c.state == "serving", 5, "the consumer to serve")
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 1}} for i in range(3)])
    results = await p.gather(handles, timeout=10)
    assert all(r.ok for r in results)
    await bounded(late_reply_handled.wait(), 10, "the late read reply to be handled")
    await asyncio.sleep(0.2)  # let a second start, if any, finish
    assert engine.submits == {h.id: 1 for h in handles}, "a job was started twice by one consumer"
    assert c.counters.refused_duplicates == 0


# ----------------------------------------------------------------------------------------
# (f) SIGTERM drain
# ----------------------------------------------------------------------------------------
async def test_sigterm_finishes_inflight_jobs_and_exits_0(queue, redis_url, make_producer, make_consumer, spawn, redis_client):
    k = QueueKeys(queue)
    proc = spawn(redis_url, queue, "draining", 100, max_inflight=5, drain_timeout=10, **LEASE)
    await proc.ready()
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 8}} for i in range(8)])  # 0.8 s each

    async def holds_five() -> bool:
        return len(await pending_of(redis_client, k.jobs, "draining")) == 5

    await until(holds_five, 5, "the consumer to take 5 jobs")
    t0 = time.monotonic()
    proc.terminate()
    assert await proc.wait(8) == 0, proc.stderr()
    took = time.monotonic() - t0
    assert took < 5, f"drain took {took:.1f}s for jobs of 0.8s"
    await until(lambda: p.counters["results"] >= 5, 3, "the drained results")
    first = await p.gather(handles[:5], timeout=3)
    assert all(r.ok and r.replica == "draining" and r.deliveries == 1 for r in first)
    # it took nothing more once told to stop; the rest wait for another replica
    assert p.counters["results"] == 5
    assert await redis_client.xlen(k.jobs) == 3
    assert not await redis_client.exists(k.heartbeat("draining"))
    c = make_consumer(queue, consumer_id="next")
    await make_consumer.burst(c)
    rest = await p.gather(handles[5:], timeout=5)
    assert all(r.ok and r.replica == "next" and r.deliveries == 1 for r in rest)
    assert p.counters["results"] == 8


async def test_sigterm_with_short_drain_hands_jobs_back(queue, redis_url, make_producer, make_consumer, spawn, redis_client):
    k = QueueKeys(queue)
    proc = spawn(redis_url, queue, "quitter", 100, max_inflight=6, drain_timeout=0.5, **LEASE)
    await proc.ready()
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 20}} for i in range(6)])  # 2 s each

    async def holds_all() -> bool:
        return len(await pending_of(redis_client, k.jobs, "quitter")) == 6

    await until(holds_all, 5, "the consumer to take every job")
    heir = make_consumer(queue, consumer_id="heir", engine=EchoEngine(delay_per_token=0.01))
    make_consumer.start(heir)
    t0 = time.monotonic()
    proc.terminate()
    assert await proc.wait(6) == 0, proc.stderr()
    assert time.monotonic() - t0 < 0.5 + 3, "the drain did not stop at drain_timeout"
    got = await collect(p, 6, timeout=2 + 3, settle=0.5)
    took = time.monotonic() - t0
    assert took < 5, f"handed-back jobs took {took:.1f}s to complete"
    assert_exactly_once(got, [h.id for h in handles])
    assert all(rs[0].replica == "heir" and rs[0].deliveries == 2 for rs in got.values())
    assert p.counters["results"] == 6
    assert heir.counters.reclaimed == 6
    assert (await stats(redis_client, queue))["completed"] == 6


# ----------------------------------------------------------------------------------------
# shutdown is bounded
# ----------------------------------------------------------------------------------------
async def test_stop_is_bounded_when_a_task_swallows_a_cancel(queue, make_consumer, monkeypatch):
    """``asyncio.wait_for`` on Python 3.11 (which redis-py uses for socket writes) returns the
    inner result instead of raising when the cancel lands as the inner call completes. A
    background loop that loses its cancel this way must neither keep ``Consumer.run`` (and a
    SIGTERM'd replica) from returning, nor keep running after it returned."""
    entered = asyncio.Event()

    async def reclaim_once(self):
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # what the 3.11 wait_for race does: the cancel is lost
        return 0

    monkeypatch.setattr("rollq.consumer._reclaimer.Reclaimer.reclaim_once", reclaim_once)
    before = asyncio.all_tasks()
    c = make_consumer(queue, reclaim_interval=0.05)
    task = make_consumer.start(c)
    await bounded(entered.wait(), 5, "the reclaim loop to run")
    c.stop()
    try:
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "Consumer.run did not return after stop(): shutdown waits forever on a background task"
        await asyncio.sleep(0.2)
        leftover = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert not leftover, f"background tasks still running after Consumer.run returned: {leftover}"
    finally:
        for t in asyncio.all_tasks() - before:
            t.cancel()
