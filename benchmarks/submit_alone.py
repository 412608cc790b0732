"""Submit rate of one producer alone (no consumer, no peers): `python benchmarks/submit_alone.py`.

20,000 jobs of 50 int32 token ids per round, one shared SamplingParams, three rounds; prints
jobs/s and producer CPU per job. A quick check between full `queue_bench.py` runs.
"""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollq import Producer, RedisServer, SamplingParams  # noqa: E402


async def main(url: str, n: int = 20_000) -> None:
    sp = SamplingParams(max_tokens=16)
    toks = list(range(50))
    for _ in range(3):
        specs = [{"prompt_token_ids": toks, "sampling": sp} for _ in range(n)]
        async with Producer(url, "submit-alone") as p:  # a fresh producer per round: no results to wait for
            t0, c0 = time.perf_counter(), time.process_time()
            await p.submit_many(specs)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(f"{n / dt:,.0f} jobs/s, producer CPU {dc / n * 1e6:.1f} us/job")


if __name__ == "__main__":
    with RedisServer() as server:
        asyncio.run(main(server.url))
