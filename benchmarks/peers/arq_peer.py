"""arq: ``ArqRedis.enqueue_job`` in ``asyncio.gather`` batches; ``arq ... --burst`` worker."""

from __future__ import annotations

import asyncio
import os
import sys

from arq import create_pool
from arq.connections import RedisSettings

from ._tick import echo

NAME = "arq"
CONCURRENCY = 50  # enqueue_job calls in flight at once (each is one WATCH/MULTI/EXEC transaction); 1-50 measured alike
MAX_JOBS = int(os.environ.get("BENCH_ARQ_MAX_JOBS", "200"))
POLL_DELAY = float(os.environ.get("BENCH_ARQ_POLL_DELAY", "0.01"))
NOTES = {
    "enqueue": f"asyncio.gather(*(pool.enqueue_job('task', tokens, max_tokens) ...)) in batches of {CONCURRENCY} (arq has no bulk API)",
    "worker": f"arq peers.arq_peer.WorkerSettings --burst, max_jobs={MAX_JOBS}, poll_delay={POLL_DELAY}s (defaults 10 and 0.5 s cap the drain at ~20 jobs/s)",
    "results": "stored by arq (keep_result default 3600 s)",
    "round_trip": "pool.enqueue_job then job.result(poll_delay=0.001) (arq polls for results)",
    "serializer": "pickle (default)",
}

_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


async def task(ctx, tokens, max_tokens):
    return echo(tokens, max_tokens)


class WorkerSettings:
    functions = [task]
    redis_settings = RedisSettings.from_dsn(_URL)
    max_jobs = MAX_JOBS
    poll_delay = POLL_DELAY
    handle_signals = True


async def enqueue(url: str, jobs: list) -> None:
    pool = await create_pool(RedisSettings.from_dsn(url))
    for i in range(0, len(jobs), CONCURRENCY):
        await asyncio.gather(*(pool.enqueue_job("task", t, m) for t, m in jobs[i : i + CONCURRENCY]))
    await pool.aclose()


def worker_cmd(url: str, burst: bool) -> list[str]:
    cmd = [sys.executable, "-m", "arq", "peers.arq_peer.WorkerSettings"]
    return cmd + (["--burst"] if burst else [])


async def rt_open(url: str):
    return await create_pool(RedisSettings.from_dsn(url))


async def rt_call(pool, tokens, max_tokens):
    job = await pool.enqueue_job("task", tokens, max_tokens)
    return await job.result(timeout=10, poll_delay=0.001)


async def rt_close(pool) -> None:
    await pool.aclose()
