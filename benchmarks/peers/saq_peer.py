"""saq: ``Queue.enqueue`` in ``asyncio.gather`` batches; ``saq peers.saq_peer.settings``."""

from __future__ import annotations

import asyncio
import os
import sys

from saq import Queue

from ._tick import echo

NAME = "saq"
_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CONCURRENCY = 50
WORKER_CONCURRENCY = int(os.environ.get("BENCH_SAQ_CONCURRENCY", "50"))
NOTES = {
    "enqueue": f"asyncio.gather(*(queue.enqueue('task', tokens=..., max_tokens=...) ...)) in batches of {CONCURRENCY} (saq has no bulk enqueue; Queue.map also gathers enqueue())",
    "worker": f"saq peers.saq_peer.settings --workers 1, concurrency={WORKER_CONCURRENCY}",
    "results": "stored by saq (job hash kept after completion, default ttl)",
    "round_trip": "job = await queue.enqueue(...); await job.refresh(until_complete=5) (pub/sub notification; a call that times out counts as an error)",
    "serializer": "json (default)",
}

queue = Queue.from_url(_URL, name="bench")


async def task(ctx, *, tokens, max_tokens):
    return echo(tokens, max_tokens)


settings = {"queue": queue, "functions": [task], "concurrency": WORKER_CONCURRENCY}


async def enqueue(url: str, jobs: list) -> None:
    await queue.connect()
    for i in range(0, len(jobs), CONCURRENCY):
        await asyncio.gather(*(queue.enqueue("task", tokens=t, max_tokens=m) for t, m in jobs[i : i + CONCURRENCY]))
    await queue.disconnect()


def worker_cmd(url: str, burst: bool) -> list[str]:
    return [sys.executable, "-m", "saq", "peers.saq_peer.settings", "--workers", "1", "--quiet"]


async def rt_open(url: str):
    await queue.connect()
    return queue


async def rt_call(q, tokens, max_tokens):
    job = await q.enqueue("task", tokens=tokens, max_tokens=max_tokens)
    await job.refresh(until_complete=5)
    return job.result


async def rt_close(q) -> None:
    await q.disconnect()
