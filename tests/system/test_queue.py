"""The queue end to end on a real Redis: producer -> stream -> consumer (EchoEngine) -> result."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

import rollq.producer.client as client_mod
import rollq.producer._submission as submission_mod
from redis.exceptions import ConnectionError as RedisConnectionError
from rollq.consumer.engine import EchoEngine
from rollq.errors import JobCancelled, JobExpired, JobRejected, QueueFull
from rollq.keys import GROUP, QueueKeys
from rollq.settings import ProducerSettings
from tests.helpers import bounded, collect, until




async def stats(client, queue: str) -> dict[str, int]:
    raw = await client.hgetall(QueueKeys(queue).stats)
    return {k.decode(): int(v) for k, v in raw.items()}


# ----------------------------------------------------------------------------------------
# basics
# ----------------------------------------------------------------------------------------
async def test_submit_and_consume(queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    t0 = time.time()
    handles = [await p.submit("hello", sampling={"max_tokens": 3}) for _ in range(3)]
    assert all(not h.done() and not h.duplicate for h in handles)
    assert len({h.id for h in handles}) == 3
    assert p.outstanding == 3

    c = make_consumer(queue, consumer_id="replica-a")
    c.version = 7
    assert await make_consumer.burst(c) == 0

    results = await p.gather(handles, timeout=5)
    for h, r in zip(handles, results):
        assert r.ok and r.id == h.id
        assert r.replica == "replica-a"
        assert r.policy_version == (7, 7)
        assert t0 <= r.submitted <= r.started <= r.finished <= time.time()
        assert r.deliveries == 1
        assert r.prompt_tokens == 5
        assert [s.token_ids for s in r.samples] == [[104, 101, 108]]
    assert p.outstanding == 0
    assert c.counters.completed == 3 and c.counters.failed == 0
    assert await stats(redis_client, queue) == {"submitted": 3, "completed": 3}


async def test_prompt_kinds_through_echo(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    h_text = await p.submit("hi", sampling={"max_tokens": 5})
    h_tok = await p.submit(prompt_token_ids=[7, 8, 9], sampling={"max_tokens": 4})
    h_msg = await p.submit(messages=[{"role": "user", "content": "yo"}], sampling={"max_tokens": 8})
    await make_consumer.burst(make_consumer(queue))
    r_text, r_tok, r_msg = await p.gather([h_text, h_tok, h_msg], timeout=5)
    assert r_text.samples[0].token_ids == [104, 105, 104, 105, 104]
    assert r_text.prompt_tokens == 2
    assert r_tok.samples[0].token_ids == [7, 8, 9, 7]
    assert r_tok.prompt_tokens == 3
    assert r_msg.samples[0].token_ids == list(b"user: yo")
    assert all(r.samples[0].finish_reason == "length" for r in (r_text, r_tok, r_msg))


async def test_n_samples_and_logprobs(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[10, 20], sampling={"max_tokens": 3, "n": 4, "logprobs": 1})
    h1 = await p.submit(prompt_token_ids=[10, 20], sampling={"max_tokens": 3})
    await make_consumer.burst(make_consumer(queue))
    r = await bounded(h.result(), 5, "result")
    assert len(r.samples) == 4
    for j, s in enumerate(r.samples):
        assert s.token_ids == [10 + j, 20 + j, 10 + j]
        assert s.token_logprobs == [-0.5, -0.5, -0.5]
    r1 = await bounded(h1.result(), 5, "result")
    assert len(r1.samples) == 1 and r1.samples[0].token_logprobs is None


async def test_meta_is_returned_untouched(queue, make_producer, make_consumer):
    meta = {"step": 3, "group": [1, 2, {"nested": None}], "name": "ü", "f": 0.25, "raw": b"\x00\xff", "ok": True}
    p = await make_producer(queue)
    h = await p.submit("x", meta=meta, sampling={"max_tokens": 1})
    h2 = await p.submit("x", meta=[1, "two"], sampling={"max_tokens": 1})
    h3 = await p.submit("x", sampling={"max_tokens": 1})
    await make_consumer.burst(make_consumer(queue))
    r, r2, r3 = await p.gather([h, h2, h3], timeout=5)
    assert r.meta == meta
    assert r2.meta == [1, "two"]
    assert r3.meta is None


async def _check_order_and_results(queue, p, handles, redis_client, make_consumer, n):
    # stream order is submission order
    entries = await redis_client.xrange(QueueKeys(queue).jobs)
    assert len(entries) == n
    from rollq.protocol import decode_job

    assert [decode_job(f[b"d"]).id for _, f in entries] == [h.id for h in handles]
    await make_consumer.burst(make_consumer(queue))
    results = await p.gather(handles, timeout=5)
    assert [r.meta for r in results] == list(range(n))
    assert [r.samples[0].token_ids for r in results] == [[i + 1] for i in range(n)]


async def test_submit_many_streams_script_calls(queue, make_producer, make_consumer, redis_client, monkeypatch):
    """One server: a call per script_batch jobs, written as soon as built, at most
    chunk_size // script_batch calls unanswered, replies read in order."""
    calls: list[int] = []
    real_reply = submission_mod.Submission._read_replies

    async def counting(self, conn, script_calls, reran):
        calls.append(sum(len(c[2]) for c in script_calls))
        return await real_reply(self, conn, script_calls, reran)

    monkeypatch.setattr(submission_mod.Submission, "_read_replies", counting)
    p = await make_producer(queue, chunk_size=21, script_batch=7)
    specs = [{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}, "meta": i} for i in range(50)]
    handles = await p.submit_many(specs)
    assert len(handles) == 50 and len({h.id for h in handles}) == 50
    assert calls == [7] * 7 + [1], "one script call per script_batch jobs"
    assert p.outstanding == 50
    await _check_order_and_results(queue, p, handles, redis_client, make_consumer, 50)


async def test_submit_many_chunks(queue, make_producer, make_consumer, redis_client, monkeypatch):
    """The chunked path (a cluster's): one pipelined round trip per chunk."""
    calls: list[int] = []
    real = submission_mod.Submission._run_scripts

    async def counting(self, script_calls):  # one pipeline = one round trip
        calls.append(sum(len(positions) for _, _, positions in script_calls))
        return await real(self, script_calls)

    monkeypatch.setattr(submission_mod.Submission, "_run_scripts", counting)
    p = await make_producer(queue, chunk_size=7)
    specs = [{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}, "meta": i} for i in range(50)]
    handles = await p._submission._submit_many_chunks(specs)
    assert len(handles) == 50 and len({h.id for h in handles}) == 50
    assert calls == [7] * 7 + [1], "one round trip per chunk_size jobs"
    await _check_order_and_results(queue, p, handles, redis_client, make_consumer, 50)


async def test_submit_many_reloads_a_flushed_script(queue, make_producer, make_consumer, redis_client):
    """SCRIPT FLUSH between batches: every streamed call that met NOSCRIPT runs again, once."""
    p = await make_producer(queue, chunk_size=20, script_batch=5)
    await redis_client.script_flush()
    specs = [{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}, "meta": i} for i in range(23)]
    handles = await p.submit_many(specs)
    assert len(handles) == 23 and p.outstanding == 23
    await _check_order_and_results(queue, p, handles, redis_client, make_consumer, 23)


async def test_submit_many_resends_after_a_failed_read(queue, make_producer, redis_client, monkeypatch):
    """A read that fails after a reply was read: every call in flight is written again on a new
    connection (a call that ran replays its reply), the batch completes, nothing doubles."""
    p = await make_producer(queue, chunk_size=20, script_batch=5)
    real_reply = submission_mod.Submission._read_replies
    seen = []

    async def failing(self, conn, script_calls, reran):
        seen.append(len(script_calls))
        if len(seen) == 2:  # after a reply was read; the calls in flight ran
            raise RedisConnectionError("dropped")
        return await real_reply(self, conn, script_calls, reran)

    monkeypatch.setattr(submission_mod.Submission, "_read_replies", failing)
    handles = await p.submit_many([{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(40)])
    assert len(handles) == 40 and p.outstanding == 40 and p.counters["resends"] == 1
    assert await redis_client.xlen(QueueKeys(queue).jobs) == 40, "the resent calls replayed their replies"


async def test_submit_many_releases_room_when_redis_stays_unreachable(queue, redis_url, monkeypatch):
    """Reads keep failing past command_timeout: SubmitInterrupted; only the jobs whose replies
    were read hold room, and the pool is fine afterwards."""
    import dataclasses

    from rollq.errors import SubmitInterrupted
    from rollq.settings import ProducerSettings, RedisSettings

    rs = dataclasses.replace(RedisSettings.from_url(redis_url), command_timeout=0.3)
    p = await client_mod.Producer(rs, queue, settings=ProducerSettings(chunk_size=20, script_batch=5)).connect()
    real_reply = submission_mod.Submission._read_replies
    seen = []

    async def failing(self, conn, script_calls, reran):
        seen.append(len(script_calls))
        if len(seen) >= 2:
            raise RedisConnectionError("dropped")
        return await real_reply(self, conn, script_calls, reran)

    monkeypatch.setattr(submission_mod.Submission, "_read_replies", failing)
    try:
        with pytest.raises(SubmitInterrupted, match="command_timeout=0.3s") as ei:
            await p.submit_many([{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(40)])
        assert len(ei.value.enqueued) == 5 and p.outstanding == 5, "only the first call's jobs were acknowledged"
        assert ei.value.in_doubt
        monkeypatch.setattr(submission_mod.Submission, "_read_replies", real_reply)
        h = await p.submit_many([{"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}])  # the pool is fine
        assert len(h) == 1 and p.outstanding == 6
    finally:
        await p.close()


async def test_build_jobs_matches_build_job(queue, make_producer):
    """The inline common shape of build_jobs gives the jobs and refusals build_job gives."""
    from rollq.protocol import SamplingParams

    p = await make_producer(queue, max_prompt_bytes=64)
    sp = SamplingParams(max_tokens=3)
    specs = [
        {"prompt_token_ids": [1, 2, 3], "sampling": sp},
        {"prompt_token_ids": [4, 5], "sampling": {"max_tokens": 2}},
        {"prompt_token_ids": [6], "sampling": sp, "meta": 1},
        {"prompt": "text", "sampling": sp},
        {"prompt_token_ids": [7], "sampling": None},
    ]
    fast = p.build_jobs(specs)
    q = await make_producer(queue, producer_id=p.id, max_prompt_bytes=64)
    slow = [q.build_job(s) for s in specs]
    strip = lambda j: msgspec.structs.replace(j, submitted=0.0)  # noqa: E731
    assert [strip(j) for j in fast] == [strip(j) for j in slow]
    assert p._seq == q._seq == len(specs)
    for bad in (
        {"prompt_token_ids": [1] * 17, "sampling": sp},  # 68 bytes > 64
        {"prompt_token_ids": [2**31], "sampling": sp},
        {"prompt_token_ids": ["x"], "sampling": sp},
        {"prompt_token_ids": [1], "sampling": {"max_tokens": 0}},
        {"prompt_token_ids": [1], "sampling": {"nope": 1}},
    ):
        with pytest.raises(Exception) as e_fast:
            p.build_jobs([specs[0], bad])
        with pytest.raises(Exception) as e_slow:
            q.build_job(bad)
        assert type(e_fast.value) is type(e_slow.value) and str(e_fast.value) == str(e_slow.value)


async def test_results_iterator_yields_each_once(queue, make_producer, make_consumer):
    p = await make_producer(queue, result_batch=16)
    handles = await p.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 2}} for i in range(100)])
    first = await p.submit("awaited by handle", sampling={"max_tokens": 1})
    await make_consumer.burst(make_consumer(queue))
    r_first = await bounded(first.result(), 5, "first result")
    assert r_first.ok

    seen: list[str] = []

    async def drain():
        async for r in p.results():
            seen.append(r.id)
            if len(seen) == 100:
                return

    await bounded(drain(), 10, "100 results from results()")
    assert sorted(seen) == sorted(h.id for h in handles)
    assert first.id not in seen, "a result taken by its handle is not yielded again"
    # nothing more comes, and nothing is yielded twice
    extra = [r async for r in p.results(timeout=0.3)]
    assert extra == []
    assert p.outstanding == 0
    assert p.counters["results"] == 101
    # handles keep their results after results() took them
    assert [(await h.result(timeout=1)).id for h in handles[:3]] == [h.id for h in handles[:3]]
    assert p.outstanding == 0


async def test_waits_on_one_handle_are_independent(queue, make_producer, make_consumer):
    import gc

    p = await make_producer(queue)
    h = await p.submit("twice", sampling={"max_tokens": 1})
    patient = asyncio.ensure_future(h.result(timeout=30))
    with pytest.raises(TimeoutError):
        await h.result(timeout=0.05)  # an impatient waiter gives up...
    await make_consumer.burst(make_consumer(queue))
    r = await bounded(patient, 10, "the patient waiter")  # ...the other still gets the result
    assert r.ok and await h.result() is r
    assert p.outstanding == 0
    # handles hold their producer weakly and are not tracked by the garbage collector
    assert not gc.is_tracked(h)


async def test_handle_timeout_without_consumer(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    h = await p.submit("nobody home", sampling={"max_tokens": 1})
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await h.result(timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 2
    assert not h.done()
    # the handle stays usable: a consumer arrives later and the result is delivered
    await make_consumer.burst(make_consumer(queue))
    r = await bounded(h.result(timeout=5), 6, "result after the timeout")
    assert r.ok
    assert p.outstanding == 0


# ----------------------------------------------------------------------------------------
# idempotency and cancellation
# ----------------------------------------------------------------------------------------
async def test_idempotent_resubmission_while_queued(queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    h1 = await p.submit("same", id="job-42", sampling={"max_tokens": 2})
    h2 = await p.submit("same", id="job-42", sampling={"max_tokens": 2})
    (h3,) = await p.submit_many([{"prompt": "same", "id": "job-42", "sampling": {"max_tokens": 2}}])
    assert (h1.duplicate, h2.duplicate, h3.duplicate) == (False, True, True)
    assert h1.id == h2.id == h3.id == "job-42"
    assert await redis_client.xlen(QueueKeys(queue).jobs) == 1
    assert p.outstanding == 1
    assert p.counters["submitted"] == 1 and p.counters["duplicates"] == 2

    c = make_consumer(queue)
    await make_consumer.burst(c)
    assert c.counters.completed == 1
    r1 = await bounded(h1.result(), 5, "result")
    assert r1.ok and r1.id == "job-42"
    r2 = await bounded(h2.result(), 5, "result of the duplicate handle")
    assert r2 is r1
    assert [r async for r in p.results(timeout=0.3)] == []
    assert p.outstanding == 0
    assert p.counters["results"] == 1
    assert (await stats(redis_client, queue))["submitted"] == 1


async def test_duplicate_ids_within_one_batch(queue, make_producer, make_consumer, redis_client):
    """The first of two equal ids in one submit_many is the one enqueued, the second the duplicate."""
    p = await make_producer(queue)
    h1, h2 = await p.submit_many([{"prompt": "a", "id": "twin"}, {"prompt": "a", "id": "twin"}])
    assert await redis_client.xlen(QueueKeys(queue).jobs) == 1
    assert p.outstanding == 1
    assert (h1.duplicate, h2.duplicate) == (False, True)


async def test_cancel_queued_job(queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    ha = await p.submit("cancel me", sampling={"max_tokens": 4})
    hb = await p.submit("keep me", sampling={"max_tokens": 4})
    assert await ha.cancel() is True
    with pytest.raises(JobCancelled):
        await bounded(ha.result(), 2, "the cancelled handle")
    assert await p.cancel("no-such-job") is False

    engine = EchoEngine()
    c = make_consumer(queue, engine=engine)
    await make_consumer.burst(c)
    rb = await bounded(hb.result(), 5, "result of the job that was not cancelled")
    assert rb.ok
    # the cancelled job was removed from the queue: no replica ever saw it
    assert engine.stats().generated_tokens == 4, "the cancelled job ran on the engine"
    assert (c.counters.pulled, c.counters.completed, c.counters.failed) == (1, 1, 0)
    st = await stats(redis_client, queue)
    assert st.get("completed") == 1 and st.get("cancelled") == 1 and not st.get("failed")
    assert not await redis_client.exists(QueueKeys(queue).ids)
    assert await redis_client.xlen(QueueKeys(queue).jobs) == 0
    # room accounted once: only the kept job's result arrives
    await until(lambda: p.counters["results"] == 1, 5, "the kept job's result to reach the producer")
    assert p.outstanding == 0
    assert [r async for r in p.results(timeout=0.2)] == []


async def test_cancel_running_job(queue, make_producer, make_consumer, redis_client):
    engine = EchoEngine(delay_per_token=0.05)  # 100 tokens: 5 s
    c = make_consumer(queue, engine=engine)
    make_consumer.start(c)
    p = await make_producer(queue)
    h = await p.submit("long", sampling={"max_tokens": 100})
    await until(lambda: engine.stats().running == 1, 5, "the job to start on the engine")
    t0 = time.monotonic()
    assert await h.cancel() is True
    with pytest.raises(JobCancelled):
        await bounded(h.result(), 2, "the cancelled handle")
    await until(lambda: engine.stats().running == 0, 2, "the engine request to be aborted")
    await until(lambda: c.counters.failed == 1, 3, "the consumer to finish the job as cancelled")
    assert time.monotonic() - t0 < 3, "the job ran to completion instead of being aborted"
    assert c.counters.completed == 0
    st = await stats(redis_client, queue)
    assert st.get("failed") == 1 and "completed" not in st
    assert not await redis_client.exists(QueueKeys(queue).ids)
    await until(lambda: p.counters["results"] == 1, 3, "the cancelled result to reach the producer")
    assert p.outstanding == 0
    # the consumer keeps serving
    h2 = await p.submit("next", sampling={"max_tokens": 2})
    assert (await bounded(h2.result(), 5, "a job after the cancel")).ok
    await make_consumer.stop(c)


async def test_deadline_expiry(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    h = await p.submit("late", timeout=0.2, sampling={"max_tokens": 3})
    h_ok = await p.submit("no deadline", sampling={"max_tokens": 3})
    h_far = await p.submit("far deadline", timeout=60, sampling={"max_tokens": 3})
    await asyncio.sleep(0.3)  # let the deadline pass while no consumer runs
    engine = EchoEngine()
    c = make_consumer(queue, engine=engine)
    await make_consumer.burst(c)
    with pytest.raises(JobExpired, match="deadline"):
        await bounded(h.result(), 5, "the expired job")
    assert (await bounded(h_ok.result(), 5, "result")).ok
    assert (await bounded(h_far.result(), 5, "result")).ok
    assert engine.stats().generated_tokens == 6, "the expired job ran"
    r = await h.result(raise_error=False)
    assert r.error.type == "JobExpired" and r.id == h.id


# ----------------------------------------------------------------------------------------
# backpressure
# ----------------------------------------------------------------------------------------
async def test_queue_full_raises(queue, make_producer, make_consumer):
    p = await make_producer(queue, max_outstanding=3, block_when_full=False)
    hs = [await p.submit("x", sampling={"max_tokens": 1}) for _ in range(3)]
    with pytest.raises(QueueFull, match="max_outstanding"):
        await p.submit("one too many")
    with pytest.raises(QueueFull, match="max_outstanding"):
        await p.submit_many([{"prompt": "x"}] * 4)
    assert p.outstanding == 3
    await make_consumer.burst(make_consumer(queue))
    # results that arrived but were not consumed still count as outstanding
    await until(lambda: p.counters["results"] == 3, 5, "the results to arrive")
    with pytest.raises(QueueFull):
        await p.submit("still full")
    await p.gather(hs, timeout=5)
    assert p.outstanding == 0
    h = await p.submit("room again", sampling={"max_tokens": 1})
    assert p.outstanding == 1 and not h.duplicate


async def test_block_when_full_waits_for_consumption(queue, make_producer, make_consumer):
    p = await make_producer(queue, max_outstanding=2, block_when_full=True)
    h1 = await p.submit("a", sampling={"max_tokens": 1})
    h2 = await p.submit("b", sampling={"max_tokens": 1})
    blocked = asyncio.create_task(p.submit("c", sampling={"max_tokens": 1}))
    await asyncio.sleep(0.2)
    assert not blocked.done(), "submit did not block at max_outstanding"
    await make_consumer.burst(make_consumer(queue))
    await until(lambda: p.counters["results"] == 2, 5, "the first two results to arrive")
    await asyncio.sleep(0.1)
    assert not blocked.done(), "submit unblocked before any result was consumed"
    assert (await h1.result()).ok  # consuming one result makes room for one job
    h3 = await bounded(blocked, 3, "the blocked submit to proceed")
    assert p.outstanding == 2
    await make_consumer.burst(make_consumer(queue))
    assert (await bounded(h3.result(), 5, "third result")).ok
    assert (await h2.result()).ok
    assert p.outstanding == 0


# ----------------------------------------------------------------------------------------
# routing and versions
# ----------------------------------------------------------------------------------------
async def test_targeted_jobs_run_only_on_their_replica(queue, make_producer, make_consumer, redis_client):
    p = await make_producer(queue)
    targeted = await p.submit_many([{"prompt": f"t{i}", "replica": "X", "sampling": {"max_tokens": 1}} for i in range(20)])
    # Y alone: drains the shared stream, leaves X's jobs alone
    y = make_consumer(queue, consumer_id="Y")
    await make_consumer.burst(y)
    assert y.counters.pulled == 0
    assert not any(h.done() for h in targeted)
    assert await redis_client.xlen(QueueKeys(queue).replica_jobs("X")) == 20
    # both together, with untargeted jobs too
    shared = await p.submit_many([{"prompt": f"s{i}", "sampling": {"max_tokens": 1}} for i in range(40)])
    targeted += await p.submit_many([{"prompt": f"u{i}", "replica": "X", "sampling": {"max_tokens": 1}} for i in range(20)])
    x, y2 = make_consumer(queue, consumer_id="X", batch=4), make_consumer(queue, consumer_id="Y", batch=4)
    await bounded(asyncio.gather(make_consumer.burst(x), make_consumer.burst(y2)), 20, "both consumers")
    rt = await p.gather(targeted, timeout=5)
    rs = await p.gather(shared, timeout=5)
    assert {r.replica for r in rt} == {"X"}
    assert {r.replica for r in rs} <= {"X", "Y"}
    assert x.counters.completed + y2.counters.completed == 80
    assert y2.counters.completed <= 40


async def test_min_version_hold(queue, make_producer, make_consumer):
    c = make_consumer(queue)
    assert c.version == 0
    make_consumer.start(c)
    p = await make_producer(queue)
    h_new = await p.submit("needs v1", min_version=1, sampling={"max_tokens": 2})
    h_any = await p.submit("any version", sampling={"max_tokens": 2})
    r_any = await bounded(h_any.result(), 5, "the unconstrained job")
    assert r_any.policy_version == (0, 0)
    await until(lambda: c.counters.pulled == 2, 5, "the consumer to pull the held job")
    await asyncio.sleep(0.3)
    assert not h_new.done(), "a job needing version 1 was served at version 0"
    c.version = 1
    c.release_held()
    r = await bounded(h_new.result(), 5, "the held job after the version update")
    assert r.ok and r.policy_version == (1, 1)
    assert r.deliveries == 1
    await make_consumer.stop(c)


# ----------------------------------------------------------------------------------------
# nothing left behind
# ----------------------------------------------------------------------------------------
async def test_keyspace_after_drain(queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    p = await make_producer(queue)
    c = make_consumer(queue, consumer_id="solo")
    hs = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 2}} for i in range(30)])
    hs += await p.submit_many([{"prompt": f"t{i}", "replica": "solo", "sampling": {"max_tokens": 2}} for i in range(5)])
    hc = await p.submit("cancelled", sampling={"max_tokens": 2})
    await hc.cancel()
    await make_consumer.burst(c)
    assert all(r.ok for r in await p.gather(hs, timeout=5))
    with pytest.raises(JobCancelled):
        await hc.result()
    await until(lambda: p.counters["results"] == 35, 5, "every result to reach the producer")  # the cancelled one never ran
    await p.close()

    keys = sorted(key.decode() for key in await redis_client.keys(k.pattern()))
    # the (empty) job stream keeps the consumer group; the rest are counter hashes
    assert keys == sorted([k.jobs, k.stats, k.latency, k.lag]), keys
    for key in (k.stats, k.latency, k.lag):
        assert await redis_client.type(key) == b"hash"
    assert await redis_client.xlen(k.jobs) == 0
    (group,) = await redis_client.xinfo_groups(k.jobs)
    assert group.get("pending", group.get(b"pending")) == 0
    assert not await redis_client.exists(k.ids, k.results(p.id), k.replica_jobs("solo"), k.heartbeat("solo"), k.consumers)
    assert await redis_client.exists(k.stats)


async def test_memory_does_not_grow_across_cycles(queue, fresh_redis):
    from rollq.connection import connect
    from rollq.consumer.loop import Consumer
    from rollq.producer.client import Producer
    from rollq.settings import ConsumerSettings
    from tests.helpers import FAST, run_burst
    srv = fresh_redis
    client = connect(srv.url)
    try:
        mem: list[int] = []
        own: list[dict[str, int]] = []  # MEMORY USAGE of each key of the queue
        async with Producer(srv.url, queue) as p:
            for cycle in range(3):
                specs = [{"prompt_token_ids": list(range(50)), "sampling": {"max_tokens": 4}, "meta": cycle} for _ in range(2000)]
                handles = await p.submit_many(specs)
                c = Consumer(EchoEngine(), srv.url, queue, settings=ConsumerSettings(**FAST))
                await run_burst(c, 30)
                results = await p.gather(handles, timeout=10)
                assert all(r.ok for r in results)
                assert p.outstanding == 0

                async def results_taken() -> bool:
                    return await client.xlen(QueueKeys(queue).results(p.id)) == 0

                await until(results_taken, 5, "the producer to delete the results it took")
                info = await client.info("memory")
                # client query/output buffers and the AOF buffer come and go with traffic
                mem.append(info["used_memory"] - info.get("mem_clients_normal", 0) - info.get("mem_aof_buffer", 0))
                keys = await client.keys(QueueKeys(queue).pattern())
                own.append({key.decode(): await client.memory_usage(key) for key in keys})
                assert await client.xlen(QueueKeys(queue).jobs) == 0
                assert not await client.exists(QueueKeys(queue).ids)
        # The producer's record of its last SUBMIT calls (idempotent resends) holds the replies
        # of the calls since the last trim: bounded by the calls in flight, whatever the cycle.
        calls = QueueKeys(queue).submit_calls(p.id)
        window = max(1, ProducerSettings().chunk_size // ProducerSettings().script_batch) + 1
        assert all(o.get(calls, 0) <= window * ProducerSettings().script_batch * 40 for o in own), own
        own = [{k: v for k, v in o.items() if k != calls} for o in own]
        # the queue's own keys: the same after every cycle (a stopped consumer's entry in the
        # group may remain until a peer's reclaim round removes it: a few hundred bytes)
        assert set(own[2]) == set(own[0]), own
        assert sum(own[2].values()) <= sum(own[0].values()) + 1024, own
        # the whole server's data (client and AOF buffers excluded; allocator noise allowed for)
        assert mem[2] <= mem[0] + 64 * 1024, f"used_memory less client and AOF buffers after each cycle: {mem}"
    finally:
        await client.aclose()


async def test_resubmitting_another_producers_id_does_not_hang(queue, make_producer, make_consumer):
    a = await make_producer(queue)
    b = await make_producer(queue)
    ha = await a.submit("mine", id="shared-id", sampling={"max_tokens": 2})
    hb = await b.submit("mine", id="shared-id", sampling={"max_tokens": 2})
    assert hb.duplicate and not ha.duplicate
    with pytest.raises(JobRejected, match=a.id):
        await bounded(hb.result(), 2, "the foreign duplicate's handle")
    await make_consumer.burst(make_consumer(queue))
    r = await bounded(ha.result(), 5, "the owner's result")
    assert r.ok and b.outstanding == 0


# ----------------------------------------------------------------------------------------
# the finish script on its own
# ----------------------------------------------------------------------------------------
async def test_finish_deletes_acknowledged_entries_and_refuses_second_results(queue, redis_client):
    """finish.lua: a few acknowledged entries go with one XDEL; more with one XTRIM MINID below
    the oldest pending entry, and those newer than it one by one; results packed by the
    consumer are written as they are, and a pack with a refused row is filtered in Lua; a
    second result for an entry is refused."""
    import msgpack

    from rollq.connection import FINISH

    k = QueueKeys(queue)
    res_key = k.results("prod")
    await redis_client.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
    for i in range(12):
        await redis_client.xadd(k.jobs, {"d": f"job{i}"})
    read = await redis_client.xreadgroup(GROUP, "c", {k.jobs: ">"}, count=20)
    e = [eid for eid, _ in read[0][1]]
    keys = [k.ids, k.stats, k.dlq, k.jobs, res_key]
    pack = lambda x: msgpack.packb(x, use_bin_type=False)  # noqa: E731

    async def finish(eids: list[bytes], results: list[bytes]) -> list[int]:
        rows = [(4, eid, "", 5, "", "", "completed") for eid in eids]
        packed = results[0] if len(results) == 1 else pack(results)
        return await FINISH(redis_client, keys, [GROUP, 60_000, 1000, pack(rows), 5, packed])

    async def left() -> list[bytes]:
        return [eid for eid, _ in await redis_client.xrange(k.jobs)]

    r = [f"r{i}".encode() for i in range(12)]
    # e0 still runs: e1-e5 are newer than it, deleted one by one; e0 and the rest stay
    assert await finish(e[1:6], r[1:6]) == [1] * 5
    assert await left() == [e[0]] + e[6:]
    # e0 alone: one XDEL
    assert await finish([e[0]], [r[0]]) == [1]
    assert await left() == e[6:]
    # a second result for e1 is refused, e6-e10 are taken (the pack is filtered); e11 still
    # runs: everything below it goes with the trim
    assert await finish([e[1]] + e[6:11], [b"again"] + r[6:11]) == [0] + [1] * 5
    assert await left() == [e[11]]
    assert await finish([e[11]], [r[11]]) == [1]
    assert await left() == []
    entries = await redis_client.xrange(res_key)
    got = []
    for _, f in entries:
        got += [f[b"d"]] if b"d" in f else msgpack.unpackb(f[b"b"], raw=True)
    assert got == r[1:6] + [r[0]] + r[6:12]
    assert [sorted(f) for _, f in entries] == [[b"b"], [b"d"], [b"b"], [b"d"]]
    assert (await redis_client.hgetall(k.stats)) == {b"completed": b"12"}
    (group,) = await redis_client.xinfo_groups(k.jobs)
    assert group.get("pending", group.get(b"pending")) == 0
    # nothing pending and a batch of several: trimmed up to the newest, which goes too
    for i in range(6):
        await redis_client.xadd(k.jobs, {"d": f"more{i}"})
    more = [eid for eid, _ in (await redis_client.xreadgroup(GROUP, "c", {k.jobs: ">"}, count=10))[0][1]]
    assert await finish(more, [b"m"] * 6) == [1] * 6
    assert await left() == []
    # rows that carry their own payloads (no packs) still work
    await redis_client.xadd(k.jobs, {"d": "job6"})
    (eid6,) = [eid for eid, _ in (await redis_client.xreadgroup(GROUP, "c", {k.jobs: ">"}, count=10))[0][1]]
    rows = [(4, eid6, "", 5, b"r6", "", "completed"), (4, e[0], "", 5, b"late", "", "completed")]
    assert await FINISH(redis_client, keys, [GROUP, 60_000, 1000, pack(rows)]) == [1, 0]
    assert (await redis_client.xrange(res_key))[-1][1] == {b"d": b"r6"}
    assert await left() == []


async def test_result_read_before_the_reply_of_its_submission(queue, make_producer):
    """The reader may take a result before the task that submitted the job has handled the
    script's reply (both sockets ready in one loop turn): the new handle adopts it."""
    from rollq.protocol import Result

    p = await make_producer(queue)
    early = Result(id="early-1")
    p._deliver(early)  # as the reader does when the result wins the race
    h = await p.submit("x", id="early-1")
    assert await bounded(h.result(), 2, "the adopted result") is early
    assert p.outstanding == 0
    # the same when results() took the result first
    late = Result(id="early-2")
    p._deliver(late)
    assert [r async for r in p.results(timeout=0.1)] == [late]
    h2 = await p.submit("x", id="early-2")
    assert await bounded(h2.result(), 2, "the adopted result") is late
    assert p.outstanding == 0


async def test_connect_to_an_unreachable_server_leaves_nothing_running():
    import socket

    from rollq.producer.client import Producer
    from rollq.settings import RedisSettings

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = Producer(RedisSettings.from_url(f"redis://127.0.0.1:{port}/0"), "q")
    with pytest.raises(Exception):
        await asyncio.wait_for(p.connect(), 30)
    assert p._reader is None and p._client is None and p._reader_client is None


async def test_submit_many_invalid_spec_mid_batch(queue, make_producer, redis_client):
    """The jobs before a spec that fails validation were sent and are outstanding; none after it."""
    from rollq.errors import InvalidJob

    p = await make_producer(queue, chunk_size=20, script_batch=5)
    specs = [{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(32)]
    specs[30] = {"prompt_token_ids": [1], "sampling": {"max_tokens": 0}}
    with pytest.raises(InvalidJob):
        await p.submit_many(specs)
    assert p.outstanding == 30
    assert await redis_client.xlen(QueueKeys(queue).jobs) == 30


async def test_streamed_submit_many_blocks_and_resumes_at_the_cap(queue, make_producer, make_consumer):
    """Several calls in flight and a cap smaller than the batch: the submission waits for room
    (given back as results are consumed by another task) instead of deadlocking, and ends."""
    p = await make_producer(queue, max_outstanding=10, block_when_full=True, chunk_size=20, script_batch=5)
    c = make_consumer(queue)
    make_consumer.start(c)
    reader = asyncio.create_task(collect(p, 40, 20))  # gives room back as results arrive
    handles = await bounded(p.submit_many([{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(40)]),
                            20, "the capped streamed submission")
    got = await bounded(reader, 25, "every result")
    assert sorted(got) == sorted(h.id for h in handles) and all(len(v) == 1 for v in got.values())
    assert p.outstanding == 0
