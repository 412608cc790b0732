"""Streamed jobs (``Job.stream``): tokens reach the producer while the job runs.

EchoEngine reports each sample's tokens in pieces as their time comes; the replica writes
them to the job's progress stream (rollq/consumer/_progress.py) and ``JobHandle.stream()``
reads them (rollq/producer/_progress.py), through a real redis-server.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rollq import EchoEngine
from rollq.consumer import _progress
from rollq.consumer.engine import SwapProgress
from rollq.errors import InvalidJob
from rollq.keys import FIELD, QueueKeys
from rollq.status import queue_status
from rollq.protocol import Job, ProgressEntry, SamplingParams, encode_progress, make_job, pack_i32
from rollq.producer._progress import ProgressReader, read_progress
from tests.helpers import bounded, until


async def _collect(handle) -> tuple[list[ProgressEntry], int]:
    """Every piece the handle streams, and how many came while the job had no result yet."""
    pieces, early = [], 0
    async for piece in handle.stream():
        pieces.append(piece)
        early += not handle.done()
    return pieces, early


def _joined(pieces: list[ProgressEntry], sample: int) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    lps: list[float] = []
    for p in pieces:
        if p.sample == sample:
            assert p.offset == len(ids), "a sample's pieces follow each other"
            ids += p.token_ids
            lps += p.token_logprobs or []
    return ids, lps


async def test_pieces_arrive_before_the_result_and_add_up_to_it(queue, make_producer, make_consumer, redis_client):
    c = make_consumer(queue, EchoEngine(delay_per_token=0.02))
    make_consumer.start(c)
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=list(range(1, 9)), sampling={"max_tokens": 48, "n": 2, "logprobs": 0}, stream=True)
    pieces, early = await bounded(_collect(h), 30, "the job's progress")
    res = await h.result(timeout=30)
    assert early >= 2, f"only {early} pieces came while the job ran"
    for j, s in enumerate(res.samples):
        ids, lps = _joined(pieces, j)
        assert ids and s.token_ids[: len(ids)] == ids
        assert lps == s.token_logprobs[: len(lps)]
    assert {x.attempt for x in pieces} == {(1, 0)}
    key = QueueKeys(queue).progress(p.id, h.id)
    ttl = await redis_client.pttl(key)
    assert 0 < ttl <= c.settings.progress_ttl * 1000, "the progress stream expires"
    await c.announce()  # the registry entry (rollq status, the dashboard) counts the entries
    (view,) = (await queue_status(redis_client, QueueKeys(queue))).replicas
    assert view.info["progress_sent"] >= early and view.info["progress_dropped"] == view.info["progress_failed"] == 0
    await make_consumer.stop(c)


async def test_progress_stream_is_trimmed(queue, make_producer, make_consumer, redis_client):
    c = make_consumer(queue, EchoEngine(delay_per_token=0.01), progress_maxlen=3, progress_interval=0.005)
    make_consumer.start(c)
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 128}, stream=True)
    res = await h.result(timeout=30)
    assert res.ok
    await asyncio.sleep(0.1)  # a last flush may still be on its way
    key = QueueKeys(queue).progress(p.id, h.id)
    assert c.jobs.progress.sent > 3
    assert 0 < await redis_client.xlen(key) <= 3


async def test_unstreamed_jobs_write_no_progress(queue, make_producer, make_consumer, redis_client):
    c = make_consumer(queue, EchoEngine(delay_per_token=0.005))
    make_consumer.start(c)
    p = await make_producer(queue)
    hs = [await p.submit(prompt_token_ids=[1, 2], sampling={"max_tokens": 16}) for _ in range(3)]
    assert all(r.ok for r in await p.gather(hs, timeout=30))
    assert [x async for x in hs[0].stream()] == []
    assert [k async for k in redis_client.scan_iter(match=f"*{{{queue}}}:pg:*")] == []
    assert c.jobs.progress.sent == 0


async def test_a_redis_error_writing_progress_does_not_fail_the_job(
    queue, make_producer, make_consumer, monkeypatch, redis_client
):
    def broken(entry):
        raise RedisConnectionError("progress write refused")

    monkeypatch.setattr(_progress, "encode_progress", broken)
    c = make_consumer(queue, EchoEngine(delay_per_token=0.01))
    make_consumer.start(c)
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[3, 4], sampling={"max_tokens": 32}, stream=True)
    pieces, _ = await bounded(_collect(h), 30, "the job's progress")
    res = await h.result(timeout=30)
    assert res.ok and len(res.samples[0].token_ids) == 32
    assert pieces == [] and c.jobs.progress.failed >= 1
    assert [k async for k in redis_client.scan_iter(match=f"*{{{queue}}}:pg:*")] == []


async def test_reader_follows_the_newest_delivery(redis_client, queue):
    key = QueueKeys(queue).progress("p1", "j1")

    def add(delivery: int, offset: int, ids: list[int]) -> object:
        e = ProgressEntry(delivery=delivery, sample=0, offset=offset, tokens=pack_i32(ids))
        return redis_client.xadd(key, {FIELD: encode_progress(e)})

    await add(1, 0, [1, 2])
    await add(2, 0, [7])
    await add(1, 2, [3])  # the abandoned delivery's replica wrote on for a while
    await add(2, 1, [8, 9])
    await redis_client.xadd(key, {FIELD: b"\x00garbage"})
    producer = SimpleNamespace(_client=redis_client)
    reader = ProgressReader(lambda: producer)
    result = asyncio.get_running_loop().create_future()
    got = []
    async for e in read_progress(reader, key, result):
        got.append((e.delivery, e.offset, e.token_ids))
        if len(got) == 3:
            result.set_result(None)  # the job's result is in: the iteration ends
    await reader.close()
    assert got == [(1, 0, [1, 2]), (2, 0, [7]), (2, 1, [8, 9])]


def test_echo_engine_reports_every_token_once():
    async def main() -> None:
        e = EchoEngine(delay_per_token=0.001)
        got: dict[int, bytearray] = {0: bytearray(), 1: bytearray()}
        fut = asyncio.get_running_loop().create_future()

        def progress(sample, offset, tokens, logprobs, text):
            assert offset == len(got[sample]) // 4 and not fut.done()
            got[sample] += tokens

        job = Job(id="a", reply="p", tokens=pack_i32([9, 8, 7]), sampling=SamplingParams(max_tokens=200, n=2))
        e.submit("a", job, lambda rid, out: fut.set_result(out), progress)
        out = await asyncio.wait_for(fut, 10)
        assert [bytes(got[j]) for j in (0, 1)] == [s.tokens for s in out.samples]

    asyncio.run(main())


def test_stream_flag_is_validated():
    assert make_job(id="a", reply="p", prompt="hi", stream=True).stream is True
    with pytest.raises(InvalidJob, match="stream"):
        make_job(id="a", reply="p", prompt="hi", stream="yes")  # type: ignore[arg-type]


async def test_streamed_jobs_of_a_sharded_queue(queue, make_producer, make_consumer, redis_client):
    """Each job's progress stream is in its shard's slot; one reader serves them all."""
    p = await make_producer(queue, shards=3)
    c = make_consumer(queue, EchoEngine(delay_per_token=0.02))
    make_consumer.start(c)
    hs = [await p.submit(prompt_token_ids=[i + 1, 2], sampling={"max_tokens": 40}, stream=True) for i in range(6)]
    assert len({h._entry[0] for h in hs}) == 3  # round robin over the shards
    got = await bounded(asyncio.gather(*(_collect(h) for h in hs)), 30, "the jobs' progress")
    for h, (pieces, early) in zip(hs, got):
        res = await h.result(timeout=30)
        ids, _ = _joined(pieces, 0)
        assert early >= 1 and ids and res.samples[0].token_ids[: len(ids)] == ids
    tags = {k.split(b"}")[0] async for k in redis_client.scan_iter(match=f"*{queue}*:pg:*")}
    assert len(tags) == 3


async def test_a_redelivered_job_streams_its_new_delivery(queue, redis_url, make_producer, make_consumer, spawn, redis_client):
    """The replica dies mid-job (SIGKILL); a live one reruns the job as delivery 2. The pieces
    of delivery 1 stop, delivery 2's start again at offset 0, and the result is delivery 2's."""
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[4, 5, 6], sampling={"max_tokens": 80}, stream=True)
    proc = await spawn(redis_url, queue, "doomed", 50.0, lease_ttl=1.0, heartbeat=0.2).ready()  # 4 s for the job
    it = h.stream().__aiter__()
    first = await bounded(it.__anext__(), 15, "the first piece")
    assert first.attempt == (1, 0) and first.offset == 0
    proc.kill()
    c = make_consumer(queue, EchoEngine(delay_per_token=0.01), consumer_id="survivor")
    make_consumer.start(c)
    rest = await bounded(_rest_of(it), 30, "the rest of the pieces")
    res = await h.result(timeout=30)
    assert res.deliveries == 2 and res.replica == "survivor"
    assert {x.attempt for x in rest} <= {(1, 0), (2, 0)} and any(x.attempt == (2, 0) for x in rest)
    again = [x for x in rest if x.attempt == (2, 0)]
    assert again[0].offset == 0 and all(x.attempt == (2, 0) for x in rest[rest.index(again[0]) :])
    ids, _ = _joined(again, 0)
    assert res.samples[0].token_ids[: len(ids)] == ids


async def _rest_of(it) -> list[ProgressEntry]:
    return [x async for x in it]


async def test_a_swap_that_restarts_a_job_drops_what_its_run_made_during_the_swap(queue, make_producer, make_consumer):
    """Progress is held back while a weight swap is under way; a job the swap restarts (it
    had no token before the swap, the report says) has what was held dropped, and its new run
    streams from offset 0."""
    c = make_consumer(queue, EchoEngine(delay_per_token=0.02))
    make_consumer.start(c)
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 60}, stream=True)
    pieces: list[ProgressEntry] = []

    async def read() -> None:
        async for x in h.stream():
            pieces.append(x)

    reader = asyncio.ensure_future(read())
    await bounded(_until_pieces(pieces), 15, "the first piece")
    w = c.jobs.progress
    with c.swapping():
        await until(lambda: w._task is None, 10, "a flush under way to land")
        sent = w.sent  # entries written before the swap began
        await asyncio.sleep(0.3)  # the engine reports on, held back
        assert w.sent == sent
        c.set_version(1, SwapProgress(tokens={}, complete=True))  # "no token yet": restarted
    await bounded(reader, 30, "the job's pieces")
    res = await h.result(timeout=30)
    first = [x for x in pieces if x.attempt == (1, 0)]
    again = [x for x in pieces if x.attempt == (1, 1)]
    assert len(first) == sent, "tokens of the restarted run were published"
    assert again and again[0].offset == 0
    ids, _ = _joined(again, 0)
    assert res.ok and res.samples[0].token_ids[: len(ids)] == ids


async def _until_pieces(pieces: list) -> None:
    while not pieces:
        await asyncio.sleep(0.01)
