"""Submission is idempotent for generated ids too: a resend of a SUBMIT call that ran is a no-op.

The soak of issue 13: a producer whose connections a TCP proxy cuts every few milliseconds
submits batches of generated ids; every id must be in the stream once and come back once.
The proxy (:class:`rollq.testing.chaos.CutProxy`) runs on loopback in the test's event loop
and aborts every connection through it (both sides, buffered bytes dropped) at random
intervals.

``ROLLQ_TEST_CLIENT=/path/to/client.py`` runs the soak against another producer module (e.g.
``git show HEAD:rollq/producer/client.py``) to show that it fails there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import time
from collections import Counter

import msgpack
from redis.exceptions import ConnectionError as RedisConnectionError
import pytest

from rollq.connection import SUBMIT
from rollq.errors import SubmitInterrupted
from rollq.keys import QueueKeys
from rollq.protocol import decode_job, encode_job
from rollq.settings import ProducerSettings, RedisSettings
from rollq.testing.chaos import CutProxy
from tests.helpers import bounded, until

pytestmark = pytest.mark.chaos


def _producer_class():
    path = os.environ.get("ROLLQ_TEST_CLIENT")
    if not path:
        from rollq.producer.client import Producer

        return Producer
    spec = importlib.util.spec_from_file_location("rollq.producer._client_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Producer


@pytest.fixture
async def proxy(redis_server):
    p = await CutProxy(redis_server.port).start()
    yield p
    await p.stop()


async def _stream_ids(client, stream: str) -> Counter:
    ids: Counter = Counter()
    last = "-"
    while True:
        batch = await client.xrange(stream, min=last, count=5000)
        if last != "-":
            batch = batch[1:]
        if not batch:
            return ids
        ids.update(decode_job(f[b"d"]).id for _, f in batch)
        last = batch[-1][0]


@pytest.mark.parametrize("consumers", [0, 2], ids=["queue-only", "two-consumers"])
async def test_submit_many_through_cut_connections_has_no_duplicates(
    queue, proxy, redis_client, make_consumer, consumers
):
    """Rounds of 2,000 generated ids through a proxy cutting every 2-20 ms, at least 10 and
    until the proxy has cut 10 times (a fast machine submits a round before the first cut; 300
    rounds at most: a CI run cut only 9 times in 30): every round returns all its handles, every id is in the stream once (no
    consumers) and every result comes back once through results() (two echo consumers)."""
    rounds, per_round, max_rounds = 10, 2000, 300
    Producer = _producer_class()
    settings = ProducerSettings(chunk_size=4000, script_batch=500)
    redis_settings = dataclasses.replace(RedisSettings.from_url(proxy.url), command_timeout=20.0)
    p = Producer(redis_settings, queue, settings=settings)
    await p.connect()
    for i in range(consumers):
        make_consumer.start(make_consumer(queue, consumer_id=f"echo{i}"))
    got: Counter = Counter()

    async def collect() -> None:
        async for r in p.results():
            got[r.id] += 1

    reader = asyncio.create_task(collect()) if consumers else None
    sent: list[str] = []
    errors: list[str] = []
    short_rounds = 0
    t0 = time.monotonic()
    try:
        r = 0
        while r < rounds or (proxy.cuts < rounds and r < max_rounds):
            jobs = p.build_jobs({"prompt_token_ids": [r, i % 97 + 1], "sampling": {"max_tokens": 1}} for i in range(per_round))
            sent += [j.id for j in jobs]
            proxy.start_cutting(0.002, 0.02, seed=13 + r)
            try:
                handles = await bounded(p.submit_many(jobs), 60, f"round {r} through the cutting proxy")
                if len(handles) != per_round:
                    short_rounds += 1
            except Exception as e:  # the old client raises ConnectionError here
                errors.append(f"{type(e).__name__}: {e}")
            finally:
                proxy.stop_cutting()
            r += 1
        elapsed = time.monotonic() - t0
        assert proxy.cuts >= rounds, f"the proxy cut only {proxy.cuts} times: the test tested nothing"
        if consumers:  # every result, or none for 3 s (a lost job never returns one)
            quiet, seen_n = time.monotonic(), 0
            while sum(got.values()) < len(sent) and time.monotonic() - quiet < 3:
                await asyncio.sleep(0.05)
                if sum(got.values()) != seen_n:
                    quiet, seen_n = time.monotonic(), sum(got.values())
            await asyncio.sleep(0.5)  # late duplicates would arrive now
        in_stream = Counter() if consumers else await _stream_ids(redis_client, QueueKeys(queue).jobs)
    finally:
        if reader is not None:
            reader.cancel()
        await asyncio.wait_for(p.close(), 30)
    seen = got if consumers else in_stream
    dups = sum(1 for n in seen.values() if n > 1)
    lost = len(set(sent) - set(seen))
    extra = len(set(seen) - set(sent))
    where = "results()" if consumers else "the stream"
    assert (dups, lost, extra, len(errors), short_rounds) == (0, 0, 0, 0, 0), (
        f"in {where}: {dups} ids twice or more, {lost} lost, {extra} unknown; {len(errors)} of {r} rounds "
        f"raised (first: {errors[:1]}); {short_rounds} rounds short of handles; {proxy.cuts} cuts in {elapsed:.1f}s"
    )


# ----------------------------------------------------------------------------------------
# the script on its own
# ----------------------------------------------------------------------------------------
def _call(k: QueueKeys, producer: str, jobs: list, n: int, lo: int, inc: str = "i1", ttl_ms: int = 60_000):
    args = []
    for job in jobs:
        args += ["", encode_job(job)]
    keys = [*k.submit_keys(k.jobs), k.submit_calls(producer)]
    return keys, [msgpack.packb(args, use_bin_type=False), producer, inc, n, lo, ttl_ms]


async def test_script_replays_a_recorded_call(queue, redis_client):
    """The same call number twice: the second returns the first reply and enqueues nothing."""
    from rollq.producer.client import Producer

    k = QueueKeys(queue)
    p = Producer("redis://unused:1/0", queue, producer_id="replayer")
    jobs = p.build_jobs([{"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 1}}] * 3)
    keys, args = _call(k, "replayer", jobs, 1, 1)
    first = await SUBMIT(redis_client, keys, args)
    assert len(first[3]) == 3 and all(first[3])
    again = await SUBMIT(redis_client, keys, args)
    assert again == first
    assert await redis_client.xlen(k.jobs) == 3
    assert int(await redis_client.hget(k.stats, "submitted")) == 3
    # another call number runs
    keys2, args2 = _call(k, "replayer", jobs[:1], 2, 1)
    second = await SUBMIT(redis_client, keys2, args2)
    assert second != first and await redis_client.xlen(k.jobs) == 4
    # without the record key (rollq.status, older producers): as before, not recorded
    plain = await SUBMIT(redis_client, k.submit_keys(k.jobs), args[:2])
    assert len(plain[3]) == 3 and await redis_client.xlen(k.jobs) == 7


async def test_script_trims_the_window_and_sets_a_ttl(queue, redis_client):
    """Records below the lowest unread call number go ('lo' makes it amortised O(1)); the
    hash expires; another incarnation under the same producer id starts afresh."""
    from rollq.producer.client import Producer

    k = QueueKeys(queue)
    key = k.submit_calls("trimmer")
    p = Producer("redis://unused:1/0", queue, producer_id="trimmer")
    job = p.build_jobs([{"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}])
    for n in range(1, 6):  # five calls, nothing read yet
        await SUBMIT(redis_client, *_call(k, "trimmer", job, n, 1, ttl_ms=5000))
    fields = {f.decode() for f in await redis_client.hkeys(key)}
    assert fields == {"1", "2", "3", "4", "5", "lo", "inc"}
    assert 0 < await redis_client.pttl(key) <= 5000
    await SUBMIT(redis_client, *_call(k, "trimmer", job, 6, 5, ttl_ms=9000))  # 1-4 were read
    fields = {f.decode() for f in await redis_client.hkeys(key)}
    assert fields == {"5", "6", "lo", "inc"}
    assert int(await redis_client.hget(key, "lo")) == 5
    assert 5000 < await redis_client.pttl(key) <= 9000, "the TTL is refreshed"
    # a lower 'lowest unread' (a resend of an old call) deletes nothing more
    await SUBMIT(redis_client, *_call(k, "trimmer", job, 5, 3))
    assert {f.decode() for f in await redis_client.hkeys(key)} == {"5", "6", "lo", "inc"}
    # a producer restarted under the same id numbers from 1 again: old records are not its own
    before = await redis_client.xlen(k.jobs)
    await SUBMIT(redis_client, *_call(k, "trimmer", job, 5, 5, inc="i2"))
    assert await redis_client.xlen(k.jobs) == before + 1, "a new incarnation's call 5 runs"
    assert {f.decode() for f in await redis_client.hkeys(key)} == {"5", "lo", "inc"}
    await redis_client.pexpire(key, 1)

    async def gone() -> bool:
        return not await redis_client.exists(key)

    await until(gone, 2, "the record hash to expire")


async def test_refused_call_is_not_recorded(queue, redis_client):
    """A call the staleness bound refused did nothing: it is not recorded (a resend re-evaluates)."""
    k = QueueKeys(queue)
    from rollq.producer.client import Producer

    await redis_client.hset(k.config, mapping={"max_lag": 0, "batch": 1})
    p = Producer("redis://unused:1/0", queue, producer_id="refused")
    jobs = p.build_jobs([{"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}] * 2)
    reply = await SUBMIT(redis_client, *_call(k, "refused", jobs, 1, 1))
    assert reply[1] == 1
    assert not await redis_client.hexists(k.submit_calls("refused"), "1")


# ----------------------------------------------------------------------------------------
# the producer's use of it
# ----------------------------------------------------------------------------------------
async def test_record_hash_is_bounded_and_deleted_on_close(queue, redis_url, redis_client):
    from rollq.producer.client import Producer

    k = QueueKeys(queue)
    p = Producer(redis_url, queue, settings=ProducerSettings(chunk_size=40, script_batch=5))
    await p.connect()
    key = k.submit_calls(p.id)
    for _ in range(3):
        await p.submit_many([{"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}] * 200)
        await p.submit("one", sampling={"max_tokens": 1})
        records = [f for f in await redis_client.hkeys(key) if f not in (b"lo", b"inc")]
        assert len(records) <= 40 // 5 + 1, f"{len(records)} records: more than the calls in flight"
    assert await redis_client.pttl(key) > 0
    await p.close()
    assert not await redis_client.exists(key)


@pytest.mark.parametrize("path", ["submit", "chunks"])
async def test_lost_reply_resend_is_idempotent(queue, redis_url, redis_client, monkeypatch, path):
    """submit() and the chunked (cluster) path: the reply of a call that ran is lost; the
    resend (same call numbers) returns it, nothing doubles."""
    from rollq.producer import _submission as submission_mod
    from rollq.producer.client import Producer

    k = QueueKeys(queue)
    p = Producer(redis_url, queue, settings=ProducerSettings(chunk_size=10, script_batch=5))
    await p.connect()
    real = submission_mod.Submission._run_scripts_now
    lost = []

    async def lose_replies(self, calls):
        out = await real(self, calls)
        if len(lost) < 2:  # the first two rounds ran, their replies are lost
            lost.append(out)
            raise RedisConnectionError("reply lost")
        return out

    monkeypatch.setattr(submission_mod.Submission, "_run_scripts_now", lose_replies)
    try:
        if path == "submit":
            handles = [await bounded(p.submit("x", sampling={"max_tokens": 1}), 10, "the resent submit")]
        else:
            specs = [{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(25)]
            handles = await bounded(p._submission._submit_many_chunks(specs), 10, "the resent chunks")
        assert len(lost) == 2 and p.counters["resends"] == 2 and not any(h.duplicate for h in handles)
        entries = await redis_client.xrange(k.jobs)
        assert [decode_job(f[b"d"]).id for _, f in entries] == [h.id for h in handles]
        assert [h._entry[1] for h in handles] == [eid for eid, _ in entries]
    finally:
        await p.close()


async def test_submit_many_unreachable_raises_submit_interrupted(queue, proxy, redis_client):
    """Redis unreachable past command_timeout: SubmitInterrupted says what is enqueued (handles),
    what is in doubt and what was never sent; resume() sends the in-doubt calls again under their
    numbers, so nothing doubles."""
    from rollq.producer.client import Producer

    k = QueueKeys(queue)
    rs = dataclasses.replace(RedisSettings.from_url(proxy.url), command_timeout=1.0, connect_timeout=0.5)
    p = Producer(rs, queue, settings=ProducerSettings(chunk_size=20, script_batch=5))
    await p.connect()
    try:
        real = p._submission._read_replies
        reads = []

        async def read_then_go_dark(conn, calls, reran):
            reads.append(1)
            if len(reads) == 2:  # the first reply was read; then Redis becomes unreachable
                proxy.dark = True
                proxy.cut()
            return await real(conn, calls, reran)

        p._submission._read_replies = read_then_go_dark
        jobs = p.build_jobs([{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 1}} for i in range(40)])
        t0 = time.monotonic()
        with pytest.raises(SubmitInterrupted, match="command_timeout") as ei:
            await bounded(p.submit_many(jobs), 15, "the interrupted submission")
        took = time.monotonic() - t0
        err = ei.value
        assert took < 6, f"gave up after {took:.1f}s (command_timeout 1s)"
        assert [h.id for h in err.enqueued] == [j.id for j in jobs[: len(err.enqueued)]]
        assert len(err.enqueued) >= 5 and err.in_doubt
        order = [j.id for j in (*[h for h in err.enqueued], *err.in_doubt, *err.not_sent)]
        assert order == [j.id for j in jobs[: len(order)]], "enqueued, in doubt, not sent, remaining: in order"
        proxy.dark = False
        del p._submission._read_replies
        more = await bounded(err.resume(), 10, "the resumed submission")
        assert [h.id for h in more] == [j.id for j in jobs[len(err.enqueued) :]]
        ids = await _stream_ids(redis_client, k.jobs)
        assert sorted(ids) == sorted(j.id for j in jobs) and set(ids.values()) == {1}
        assert p.outstanding == 40
    finally:
        proxy.dark = False
        await p.close()


async def test_a_second_result_for_a_delivered_id_is_dropped(queue, make_producer, redis_client):
    from rollq.protocol import Result

    p = await make_producer(queue)
    h = await p.submit("x", sampling={"max_tokens": 1})
    first = Result(id=h.id)
    p._deliver(first)
    assert await bounded(h.result(), 2, "the result") is first
    p._deliver(Result(id=h.id))  # a late duplicate, after the result was consumed
    assert [r async for r in p.results(timeout=0.1)] == []
    assert p.outstanding == 0 and p.counters["duplicate_results"] == 1
    # a caller-chosen id resubmitted after its result was consumed gets its new result
    h1 = await p.submit("x", id="mine", sampling={"max_tokens": 1})
    p._deliver(r1 := Result(id="mine"))
    assert await h1.result() is r1
    await redis_client.hdel(QueueKeys(queue).ids, "mine")  # as finish.lua does when the job ends
    h2 = await p.submit("x", id="mine", sampling={"max_tokens": 1})
    assert not h2.duplicate
    p._deliver(r2 := Result(id="mine"))
    assert await bounded(h2.result(), 2, "the second run's result") is r2
