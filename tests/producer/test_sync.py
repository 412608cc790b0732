"""The blocking facade (:mod:`rollq.producer.sync`) over a real redis-server and an echo replica."""

from __future__ import annotations

import asyncio

from rollq import EchoEngine
from rollq.producer.sync import SyncProducer


async def test_a_sync_handle_streams_pieces_while_the_job_runs_then_its_result(queue, redis_url, make_consumer):
    """``SyncJobHandle.stream()`` yields the job's pieces before its result is in, and they add
    up to the result's tokens; ``results()`` still iterates over a producer's results."""
    c = make_consumer(queue, EchoEngine(delay_per_token=0.02))
    make_consumer.start(c)

    def run():
        with SyncProducer(redis_url, queue) as p:
            h = p.submit(prompt_token_ids=list(range(1, 9)), sampling={"max_tokens": 48}, stream=True)
            pieces, early = [], 0
            for piece in h.stream():
                pieces.append(piece)
                early += not h.done()
            res = h.result(timeout=30)
            p.submit(prompt_token_ids=[1, 2], sampling={"max_tokens": 2})
            more = next(p.results(timeout=30))
            return pieces, early, res, more

    pieces, early, res, more = await asyncio.wait_for(asyncio.to_thread(run), 60)
    assert early >= 2, f"only {early} pieces came while the job ran"
    ids = [t for piece in pieces for t in piece.token_ids]
    assert [piece.offset for piece in pieces] == [sum(len(q.token_ids) for q in pieces[:k]) for k in range(len(pieces))]
    assert ids and res.samples[0].token_ids[: len(ids)] == ids
    assert len(more.samples[0].token_ids) == 2
    await make_consumer.stop(c)
