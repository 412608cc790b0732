"""taskiq-redis: ``RedisStreamBroker`` (Redis Streams) + redis result backend; ``taskiq worker``."""

from __future__ import annotations

import asyncio
import os
import sys

from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

from ._tick import echo

NAME = "taskiq"
_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CONCURRENCY = 50
MAX_ASYNC = 100
NOTES = {
    "enqueue": f"asyncio.gather(*(task.kiq(tokens, max_tokens) ...)) in batches of {CONCURRENCY} (one XADD per kiq; no bulk API)",
    "broker": "taskiq_redis.RedisStreamBroker (Redis Streams, consumer group, XACK), xread_count=100",
    "worker": f"taskiq worker peers.taskiq_peer:broker --workers 1 --max-async-tasks {MAX_ASYNC} (one worker process)",
    "results": "RedisAsyncResultBackend ON (result_ex_time 3600 s)",
    "round_trip": "await (await task.kiq(...)).wait_result(check_interval=0.001) (taskiq polls for results)",
    "serializer": "json (default)",
}

broker = RedisStreamBroker(url=_URL, queue_name="bench", consumer_id="0").with_result_backend(
    RedisAsyncResultBackend(redis_url=_URL, result_ex_time=3600)
)


@broker.task(task_name="bench.task")
async def task(tokens, max_tokens):
    return echo(tokens, max_tokens)


async def enqueue(url: str, jobs: list) -> None:
    await broker.startup()
    for i in range(0, len(jobs), CONCURRENCY):
        await asyncio.gather(*(task.kiq(t, m) for t, m in jobs[i : i + CONCURRENCY]))
    await broker.shutdown()


def worker_cmd(url: str, burst: bool) -> list[str]:
    return [
        sys.executable, "-m", "taskiq", "worker", "peers.taskiq_peer:broker", "--workers", "1",
        "--max-async-tasks", str(MAX_ASYNC), "--log-level", "WARNING",
    ]


async def rt_open(url: str):
    await broker.startup()
    return broker


async def rt_call(ctx, tokens, max_tokens):
    t = await task.kiq(tokens, max_tokens)
    res = await t.wait_result(check_interval=0.001, timeout=10)
    return res.return_value


async def rt_close(ctx) -> None:
    await broker.shutdown()
