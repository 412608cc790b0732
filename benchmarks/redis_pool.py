"""What waiting for a pooled Redis connection costs on the hot path, and what a burst gets.

    python benchmarks/redis_pool.py [--before REV] [--reps 9] [--out benchmarks/results/redis_pool]

``connect()`` of the ``rollq`` package at REV (redis-py's pool, which refuses a command beyond
``max_connections``) against the working tree's (``rollq.pools``: such a command waits its
turn), one redis-server, the sides alternating within each repetition. Workloads:

- ``sequential``: one task, 20,000 GET round trips (no contention; the per-command cost).
- ``concurrent 64``: 64 tasks x 300 GETs on a pool of 64 (the pool just big enough).
- ``burst 2000``: 2,000 GETs started at once on a pool of 64 (commands beyond the pool).

Reports commands/s (wall), client CPU per command, and for the burst how many commands
failed. Ratios are after/before of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

_root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_root))
import rollq  # noqa: E402
from rollq.server import RedisServer  # noqa: E402

sys.path.insert(0, str(_root / "benchmarks"))
from ab_revision import import_revision  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--before", default="2cb3da8", help="git revision of the 'before' package (default: before rollq.pools)")
ap.add_argument("--reps", type=int, default=9)
ap.add_argument("--out", default="benchmarks/results/redis_pool")
A = ap.parse_args()

old = import_revision(A.before)
SIDES = {"before": old, "after": rollq}


async def sequential(c) -> tuple[int, int]:
    for _ in range(20_000):
        await c.get("k")
    return 20_000, 0


async def concurrent(c) -> tuple[int, int]:
    async def worker() -> None:
        for _ in range(300):
            await c.get("k")

    await asyncio.gather(*(worker() for _ in range(64)))
    return 64 * 300, 0


async def burst(c) -> tuple[int, int]:
    got = await asyncio.gather(*(c.get("k") for _ in range(2000)), return_exceptions=True)
    return 2000, sum(isinstance(g, BaseException) for g in got)


WORKLOADS = {"sequential": sequential, "concurrent 64": concurrent, "burst 2000": burst}


async def one(pkg, url: str, work) -> tuple[float, float, int]:
    settings = importlib.import_module(f"{pkg.__name__}.settings").RedisSettings.from_url(url, max_connections=64)
    c = importlib.import_module(f"{pkg.__name__}.connection").connect(settings)
    try:
        await c.set("k", b"x" * 64)
        t0, c0 = time.perf_counter(), time.process_time()
        n, failed = await work(c)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await c.aclose()
    return n / dt, 1e6 * dc / n, failed


async def main() -> None:
    srv = RedisServer()
    srv.start()
    res = {w: {side: [] for side in SIDES} for w in WORKLOADS}
    try:
        for pkg in SIDES.values():  # warm up
            await one(pkg, srv.url, sequential)
        for r in range(A.reps):
            for name, work in WORKLOADS.items():
                for side in (list(SIDES) if r % 2 == 0 else list(reversed(SIDES))):
                    res[name][side].append(await one(SIDES[side], srv.url, work))
    finally:
        srv.cleanup()
    rows = []
    for name in WORKLOADS:
        med = {s: statistics.median(x[0] for x in res[name][s]) for s in SIDES}
        cpu = {s: statistics.median(x[1] for x in res[name][s]) for s in SIDES}
        rows.append({"workload": name, "before_cmds_s": [round(x[0]) for x in res[name]["before"]],
                     "after_cmds_s": [round(x[0]) for x in res[name]["after"]],
                     "ratio_median": round(med["after"] / med["before"], 3),
                     "client_us_per_cmd": [round(cpu[s], 2) for s in SIDES],
                     "failed_per_run": [statistics.median(x[2] for x in res[name][s]) for s in SIDES]})
        print(json.dumps(rows[-1]))
    cmd = "python benchmarks/redis_pool.py " + " ".join(sys.argv[1:])
    Path(A.out).parent.mkdir(parents=True, exist_ok=True)
    Path(A.out + ".json").write_text(json.dumps({"command": cmd, "before": A.before, "reps": A.reps, "rows": rows}, indent=2) + "\n")
    md = [f"# Pooled Redis connections, {A.before} (redis-py's pool) against the working tree (rollq.pools)", "",
          f"`{cmd}`", "",
          "| workload | before cmds/s (median) | after cmds/s (median) | after/before | client us/cmd before/after | failed commands per run before/after |",
          "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['workload']} | {statistics.median(r['before_cmds_s']):,.0f} | {statistics.median(r['after_cmds_s']):,.0f} | "
                  f"{r['ratio_median']} | {r['client_us_per_cmd'][0]} / {r['client_us_per_cmd'][1]} | "
                  f"{r['failed_per_run'][0]:g} / {r['failed_per_run'][1]:g} |")
    Path(A.out + ".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
