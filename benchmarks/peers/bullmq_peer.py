"""bullmq (Python port): ``Queue.addBulk``; one process running ``bullmq.Worker``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from bullmq import Queue, Worker

from ._tick import echo

NAME = "bullmq"
_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CHUNK = 1000
CONCURRENCY = int(os.environ.get("BENCH_BULLMQ_CONCURRENCY", "50"))
NOTES = {
    "enqueue": f"Queue.addBulk([{{'name': 'task', 'data': {{...}}}}, ...]) per {CHUNK} jobs (bullmq's bulk API)",
    "worker": f"one process: bullmq.Worker('bench', processor, concurrency={CONCURRENCY}) (no CLI, no burst mode: stopped when done)",
    "results": "kept by bullmq (removeOnComplete false by default: job hash + completed set)",
    "round_trip": "not measured (the Python port has no waitUntilFinished)",
    "serializer": "json",
}


async def processor(job, token):
    d = job.data
    return echo(d["tokens"], d["max_tokens"])


async def enqueue(url: str, jobs: list) -> None:
    q = Queue("bench", {"connection": url})
    for i in range(0, len(jobs), CHUNK):
        await q.addBulk([{"name": "task", "data": {"tokens": t, "max_tokens": m}} for t, m in jobs[i : i + CHUNK]])
    await q.close()


def worker_cmd(url: str, burst: bool) -> list[str]:
    return [sys.executable, "-m", "peers.bullmq_peer"]


async def _serve() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    w = Worker("bench", processor, {"connection": _URL, "concurrency": CONCURRENCY})
    await stop.wait()
    await w.close(force=True)


if __name__ == "__main__":
    asyncio.run(_serve())
