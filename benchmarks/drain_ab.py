"""Dispatch rate before and after a change of the consumer: one consumer of the ``rollq`` of a
git revision against one of the working tree's, one redis-server, alternating, in one run.

    python benchmarks/drain_ab.py [--before REV] [--jobs 20000] [--reps 5] [--replicas 1] [--out benchmarks/results/drain_ab]

Each repetition, for each side (alternating which goes first): that side's producer submits
N jobs of 50 token ids (one ``submit_many``), then that side's ``Consumer`` with an
``EchoEngine`` drains them (``run(burst=True)``, default settings but ``batch`` and
``max_inflight`` 256, as ``queue_bench.py``'s drain), in this process, timed from the start of
``run`` to its return; then the producer reads every result. Reports jobs/s of the drain,
this process's CPU and Redis CPU per job (``INFO cpu``), after/before medians. With
``--replicas N`` N such consumers drain the same queue at once (in this process), timed until
the last returns: the steady state of a fleet, where each replica sees the others' free slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import rollq  # noqa: E402
from ab_revision import import_revision  # noqa: E402
from rollq.connection import connect  # noqa: E402
from rollq.server import RedisServer  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="3046323", help="git revision of the 'before' package (default: before queue shards)")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=1, help="consumers draining the queue at once")
    ap.add_argument("--out", default="benchmarks/results/drain_ab")
    return ap.parse_args()


async def redis_cpu(c) -> float:
    i = await c.info("cpu")
    return i["used_cpu_user"] + i["used_cpu_sys"]


async def one(pkg, url: str, n: int, replicas: int = 1) -> tuple[float, float, float]:
    """Submit ``n`` jobs and drain them with ``pkg``'s consumer: (jobs/s, process us/job, Redis us/job)."""
    q = f"ab-{uuid.uuid4().hex[:8]}"
    sp = pkg.SamplingParams(max_tokens=16)
    p = pkg.Producer(url, q)
    hs = await p.submit_many([{"prompt_token_ids": list(range(100, 150)), "sampling": sp} for _ in range(n)])
    c = connect(url)
    settings = pkg.ConsumerSettings(batch=256, max_inflight=256, initial_inflight=256)
    consumers = [pkg.Consumer(pkg.EchoEngine(), url, q, consumer_id=f"drain{i}", settings=settings) for i in range(replicas)]
    r0, c0, t0 = await redis_cpu(c), time.process_time(), time.perf_counter()
    await asyncio.gather(*(consumer.run(burst=True) for consumer in consumers))
    dt, dc, dr = time.perf_counter() - t0, time.process_time() - c0, await redis_cpu(c) - r0
    rs = await p.gather(hs, timeout=120)
    assert len(rs) == n and all(r.ok for r in rs), "a job of the drain failed"
    await p.close()
    keys = [k async for k in c.scan_iter(f"rollq:{{{q}}}*")]
    if keys:
        await c.delete(*keys)
    await c.aclose()
    return n / dt, 1e6 * dc / n, 1e6 * dr / n


async def main() -> None:
    a = parse_args()
    sides = {"before": import_revision(a.before), "after": rollq}
    srv = RedisServer()
    srv.start()
    res: dict[str, list[tuple[float, float, float]]] = {s: [] for s in sides}
    try:
        for pkg in sides.values():  # warm up both
            await one(pkg, srv.url, 2000, a.replicas)
        for r in range(a.reps):
            for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                res[side].append(await one(sides[side], srv.url, a.jobs, a.replicas))
                sys.stderr.write(f"rep {r} {side}: {res[side][-1][0]:,.0f} jobs/s\n")
    finally:
        srv.cleanup()
    med = {s: [statistics.median(x[i] for x in res[s]) for i in range(3)] for s in sides}
    cmd = "python benchmarks/drain_ab.py " + " ".join(sys.argv[1:])
    out = {"command": cmd, "before": a.before, "jobs": a.jobs, "reps": a.reps, "replicas": a.replicas,
           "jobs_per_s": {s: [round(x[0]) for x in res[s]] for s in sides},
           "median": {s: {"jobs_per_s": round(med[s][0]), "process_us_per_job": round(med[s][1], 2),
                          "redis_us_per_job": round(med[s][2], 2)} for s in sides},
           "ratio_median": round(med["after"][0] / med["before"][0], 3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    md = [f"# Drain rate, {a.before} against the working tree ({a.replicas} consumer(s))", "", f"`{cmd}`", "",
          "| side | drain jobs/s (median) | each repetition | consumer process us/job | Redis us/job |",
          "| --- | ---: | --- | ---: | ---: |"]
    for s in sides:
        md.append(f"| {s} | {med[s][0]:,.0f} | {', '.join(f'{x:,}' for x in out['jobs_per_s'][s])} | "
                  f"{med[s][1]:.2f} | {med[s][2]:.2f} |")
    md += ["", f"after/before (median jobs/s): **{out['ratio_median']}**"]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    asyncio.run(main())
