"""rq: ``Queue.enqueue_many`` inside a redis pipeline; ``rq worker --burst`` with SimpleWorker."""

from __future__ import annotations

import sys

from redis import Redis
from rq import Queue

from ._tick import echo

NAME = "rq"
QUEUE = "bench"
CHUNK = 1000
NOTES = {
    "enqueue": f"Queue.enqueue_many([Queue.prepare_data(task, args)...], pipeline=pipe); pipe.execute() per {CHUNK} jobs (rq's documented bulk enqueue)",
    "worker": "rq worker --burst -w rq.worker.SimpleWorker (no fork per job: rq's fastest worker; the default Worker forks a work horse per job)",
    "results": "stored by rq (default result_ttl 500 s, results stream per job)",
    "round_trip": "q.enqueue(task) then job.latest_result(timeout=...) (blocking XREAD on the job's result stream)",
    "serializer": "pickle (default)",
}


def task(tokens, max_tokens):
    return echo(tokens, max_tokens)


def enqueue(url: str, jobs: list) -> None:
    r = Redis.from_url(url)
    q = Queue(QUEUE, connection=r)
    for i in range(0, len(jobs), CHUNK):
        with r.pipeline() as pipe:
            q.enqueue_many([Queue.prepare_data(task, args=(t, m)) for t, m in jobs[i : i + CHUNK]], pipeline=pipe)
            pipe.execute()
    r.close()


def worker_cmd(url: str, burst: bool) -> list[str]:
    cmd = [sys.executable, "-m", "rq.cli", "worker", "-u", url, "-w", "rq.worker.SimpleWorker", "--quiet", QUEUE]
    return cmd + (["--burst"] if burst else [])


def rt_open(url: str):
    r = Redis.from_url(url)
    return r, Queue(QUEUE, connection=r)


def rt_call(ctx, tokens, max_tokens):
    _, q = ctx
    job = q.enqueue(task, tokens, max_tokens)
    res = job.latest_result(timeout=10)
    if res is None:
        raise TimeoutError("rq result did not arrive")
    return res.return_value


def rt_close(ctx) -> None:
    ctx[0].close()
