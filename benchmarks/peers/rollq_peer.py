"""rollq driven through the same harness as the peers (``run_peer.py``), so that its figures can be
paired, in time, with each peer's: enqueue from a fresh process, drain timed inside ONE consumer
process from its first pull (``mark_start``) to its last result recorded (``tick`` per result), round trip with a non-burst consumer."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer, ConsumerCounters
from rollq.producer.client import Producer
from rollq.protocol import SamplingParams
from rollq.settings import ConsumerSettings

from ._tick import mark_start, tick

NAME = "rollq"
QUEUE = "bench"
INFLIGHT = int(os.environ.get("BENCH_ROLLQ_INFLIGHT", "4096"))
BATCH = int(os.environ.get("BENCH_ROLLQ_BATCH", "1024"))
NOTES = {
    "enqueue": "Producer.submit_many([{'prompt_token_ids': tokens, 'sampling': sp}, ...]) (one shared SamplingParams)",
    "worker": f"python -m peers.rollq_peer: Consumer(EchoEngine) run(burst=True), max_inflight={INFLIGHT}, batch={BATCH}",
    "results": "result stream per producer (read and deleted by the producer)",
    "round_trip": "await producer.submit(...); await handle.result()",
    "serializer": "msgpack (msgspec)",
}


class TickCounters(ConsumerCounters):
    """tick() when a job's outcome is recorded in Redis (FINISH done), not when the engine
    returns: rollq batches its FINISH calls, so the engine's return would flatter it."""

    def __setattr__(self, k, v):
        old = getattr(self, k, 0) if k == "completed" else 0
        object.__setattr__(self, k, v)
        if k == "completed":
            for _ in range(v - old):
                tick()


async def enqueue(url: str, jobs: list) -> None:
    sps: dict[int, SamplingParams] = {}
    async with Producer(url, QUEUE) as p:
        await p.submit_many(
            [{"prompt_token_ids": t, "sampling": sps.setdefault(m, SamplingParams(max_tokens=m))} for t, m in jobs]
        )


def worker_cmd(url: str, burst: bool) -> list[str]:
    return [sys.executable, "-m", "peers.rollq_peer", "--url", url] + (["--burst"] if burst else [])


async def rt_open(url: str):
    p = Producer(url, QUEUE)
    await p.connect()
    return p, {}


async def rt_call(ctx, tokens, max_tokens):
    p, sps = ctx
    sp = sps.setdefault(max_tokens, SamplingParams(max_tokens=max_tokens))
    h = await p.submit(prompt_token_ids=tokens, sampling=sp)
    return await h.result(timeout=10)


async def rt_close(ctx) -> None:
    await ctx[0].close()


async def _serve(url: str, burst: bool) -> int:
    c = Consumer(EchoEngine(), url, QUEUE, settings=ConsumerSettings(max_inflight=INFLIGHT, initial_inflight=INFLIGHT, batch=BATCH))
    c.counters = TickCounters()
    if not burst:
        return await c.run(install_signal_handlers=True)
    # drain: set up fully with intake closed, then time from the first pull
    c.intake_gate.clear()
    task = asyncio.create_task(c.run(burst=True, install_signal_handlers=True))
    for _ in range(3000):
        if c.state == "serving" or task.done():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    mark_start()
    c.intake_gate.set()
    return await task


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--burst", action="store_true")
    a = ap.parse_args()
    sys.exit(asyncio.run(_serve(a.url, a.burst)))
