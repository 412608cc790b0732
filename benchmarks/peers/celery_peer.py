"""celery: ``apply_async`` with one shared producer; ``celery worker -P solo -c 1``."""

from __future__ import annotations

import os
import sys

from celery import Celery

from ._tick import echo

NAME = "celery"
_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFETCH = int(os.environ.get("BENCH_CELERY_PREFETCH", "64"))
NOTES = {
    "enqueue": "with app.producer_or_acquire() as p: task.apply_async((tokens, max_tokens), producer=p) per job (one shared producer/connection; celery has no pipelined bulk publish, group() publishes one message per task the same way)",
    "worker": f"celery -A peers.celery_peer worker -P solo -c 1 --without-gossip --without-mingle --without-heartbeat, worker_prefetch_multiplier={PREFETCH}",
    "results": "redis result backend ON (same server), json serializer",
    "round_trip": "task.delay(...).get() (redis backend: pub/sub wait for the result)",
    "serializer": "json (default)",
}

app = Celery("bench", broker=_URL, backend=_URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=PREFETCH,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=False,
    result_expires=3600,
)


@app.task(name="bench.task")
def task(tokens, max_tokens):
    return echo(tokens, max_tokens)


def enqueue(url: str, jobs: list) -> None:
    with app.producer_or_acquire() as producer:
        for t, m in jobs:
            task.apply_async((t, m), producer=producer)


def worker_cmd(url: str, burst: bool) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "peers.celery_peer", "worker", "-P", "solo", "-c", "1",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "warning",
    ]


def rt_open(url: str):
    return None


def rt_call(ctx, tokens, max_tokens):
    return task.delay(tokens, max_tokens).get(timeout=10)


def rt_close(ctx) -> None:
    pass
