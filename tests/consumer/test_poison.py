"""Entries that must neither kill, wedge nor flood a replica: nesting too deep to decode,
huge ids and reply fields, results too large to record, whole payloads kept in dead letters."""

from __future__ import annotations

import msgpack
import pytest

from rollq.consumer.engine import EchoEngine
from rollq.errors import InvalidJob, ResultTooLarge
from rollq.keys import QueueKeys
from rollq.protocol import SCHEMA_VERSION, Job, decode_dead_letter, encode_job
from rollq.status import dlq_list
from tests.helpers import until

pytestmark = pytest.mark.chaos


def _nested(depth: int) -> bytes:
    head = msgpack.packb([SCHEMA_VERSION, "deep", "prod", "hi", None, None, {}, None, None, None, 0.0, None])[:-1]
    return head + b"\x91" * depth + b"\x90"


async def test_poison_entries_are_dead_lettered_at_once_and_the_replica_keeps_serving(queue, make_producer, make_consumer, redis_client):
    k = QueueKeys(queue)
    big_id = "i" * 40_000
    poison = {
        "deep": _nested(1000),
        "deeper": _nested(100_000),
        "huge-id": encode_job(Job(id=big_id, reply="prod", text="hi")),
        "huge-reply": encode_job(Job(id="r1", reply="r" * (10 << 20), text="hi")),
        "newline-reply": encode_job(Job(id="r2", reply="prod\n", text="hi")),
    }
    for payload in poison.values():
        await redis_client.xadd(k.jobs, {b"d": payload})
    p = await make_producer(queue)
    good = await p.submit_many([{"prompt": f"ok {i}", "sampling": {"max_tokens": 2}} for i in range(20)])
    c = make_consumer(queue, max_deliveries=3, dlq_payload_bytes=4096)
    task = make_consumer.start(c)
    rs = await p.gather(good, timeout=30)
    assert all(r.ok for r in rs)
    await until(lambda: c.counters.dead_lettered == len(poison), 20, "every poison entry dead-lettered")
    assert not task.done() and c.counters.pulled == len(poison) + 20  # each delivered once
    dls = [decode_dead_letter(f[b"d"]) for _, f in await redis_client.xrange(k.dlq)]
    assert len(dls) == len(poison)
    for d in dls:
        assert len(d.reason) < 1000 and (d.job_id is None or len(d.job_id) <= 256)
        assert len(d.payload) <= 4096  # the rest of a 10 MB entry is not kept
    assert max(d.payload_bytes for d in dls) > 10 << 20
    # No result key was made from a bad reply field.
    keys = [x async for x in redis_client.scan_iter(match=f"rollq:{{{queue}}}:*")]
    assert not any(b"rrrr" in x or b"\n" in x for x in keys), keys
    views = await dlq_list(redis_client, k)
    cut = [v for v in views if v.payload_bytes > v.kept_bytes]
    assert cut and not any(v.requeueable for v in cut)
    await make_consumer.stop(c)


async def test_a_result_too_large_fails_its_job_and_the_rest_are_recorded(queue, make_producer, make_consumer):
    """A result over the limit used to be retried forever while every later result queued
    behind it and the replica kept its lease."""
    c = make_consumer(queue, max_result_bytes=64 << 10)
    make_consumer.start(c)
    p = await make_producer(queue)
    big = await p.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 20_000, "n": 4, "logprobs": 0})
    small = await p.submit_many([{"prompt_token_ids": [i + 1], "sampling": {"max_tokens": 4}} for i in range(50)])
    with pytest.raises(ResultTooLarge, match="max_result_bytes"):
        await big.result(timeout=30)
    rs = await p.gather(small, timeout=30)
    assert all(r.ok for r in rs)
    await make_consumer.stop(c)


def test_finish_calls_are_bounded_in_bytes():
    from rollq.consumer.loop import FINISH_BATCH_BYTES, batch_rows

    mb = 1 << 20
    assert batch_rows([mb] * 500, FINISH_BATCH_BYTES) == FINISH_BATCH_BYTES // mb
    assert batch_rows([600 * mb, mb], FINISH_BATCH_BYTES) == 1  # a big row goes alone
    assert batch_rows([10] * 300, FINISH_BATCH_BYTES) == 300


def _largest_accepted(p, **sampling) -> int:
    """The largest ``max_tokens`` the producer accepts for a job of ``sampling`` (bisection
    over what :meth:`Producer.build_job` refuses: no Redis involved)."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            p.build_job(prompt_token_ids=[7], id="j" * 256, sampling={**sampling, "max_tokens": mid})
            lo = mid
        except InvalidJob:
            hi = mid - 1
    return lo


async def test_the_largest_job_the_producer_accepts_has_a_result_the_replica_records(
        queue, make_producer, make_consumer):
    """Used to: n=128 x 65,535 tokens with logprobs passed the producer's check (n x
    max_tokens <= 2**23) and failed after it ran with ResultTooLarge, over by 1,595 bytes:
    the submit-time bound is now the worst-case encoded result, against the same limit."""
    # the longest replica name a result carries; a context the largest job fits in
    c = make_consumer(queue, EchoEngine(max_model_len=1 << 20), consumer_id="r" * 128)
    make_consumer.start(c)
    p = await make_producer(queue)
    k = _largest_accepted(p, n=128, logprobs=0)
    assert k > 60_000  # close to 64 MiB of tokens and logprobs
    h = await p.submit(prompt_token_ids=[7], id="j" * 256, sampling={"n": 128, "max_tokens": k, "logprobs": 0})
    r = await h.result(timeout=120)  # raised ResultTooLarge
    assert len(r.samples) == 128 and all(len(s.tokens) == 4 * k for s in r.samples)
    with pytest.raises(InvalidJob, match="over the limit"):
        p.build_job(prompt_token_ids=[7], sampling={"n": 128, "max_tokens": k + 1, "logprobs": 0})
    await make_consumer.stop(c)
