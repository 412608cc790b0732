"""Submit rate before and after a change of the producer: the ``rollq`` package of a git
revision against the working tree's, one redis-server, alternating, in one run.

    python benchmarks/submit_ab.py [--before REV] [--jobs 20000] [--reps 7] [--out benchmarks/results/submit_ab]

The revision's whole ``rollq/`` (client, wire format and Lua scripts) is extracted with
``git archive`` and imported as ``rollq_before``. Three spec shapes: token prompts sharing one
SamplingParams (the fast path), token prompts with a per-job ``"sampling": {...}`` dict, and
the README's chat messages with a per-job sampling dict. Every repetition runs every shape on
both sides, alternating which goes first. Reports jobs/s (wall), producer CPU and Redis CPU
per job, after/before per shape, and each shape's rate as a share of the fast path's on the
same side.
"""
import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

_root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_root))
import rollq  # noqa: E402
from rollq.connection import connect  # noqa: E402
from rollq.server import RedisServer  # noqa: E402

sys.path.insert(0, str(_root / "benchmarks"))
from ab_revision import import_revision  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--before", default="37ee1dc~1", help="git revision of the 'before' package (default: before idempotent calls)")
ap.add_argument("--jobs", type=int, default=20000)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--out", default="benchmarks/results/submit_ab")
A = ap.parse_args()
N, REPS = A.jobs, A.reps


old = import_revision(A.before)
SIDES = {"before": old, "after": rollq}

rng = random.Random(7)
prompts = [[rng.randrange(1, 50000) for _ in range(rng.randrange(32, 256))] for _ in range(N)]
questions = [f"question {i}: what is {rng.randrange(1000)} + {rng.randrange(1000)}?" for i in range(N)]
shared = {side: pkg.SamplingParams(max_tokens=16) for side, pkg in SIDES.items()}  # each side's own class
SHAPES = {
    "shared SamplingParams": lambda side: [{"prompt_token_ids": p, "sampling": shared[side]} for p in prompts],
    "per-job sampling dict": lambda side: [{"prompt_token_ids": p, "sampling": {"max_tokens": 16, "temperature": 1.0}} for p in prompts],
    "chat messages, per-job sampling dict (README)": lambda side: [
        {"messages": [{"role": "user", "content": q}], "sampling": {"n": 8, "max_tokens": 512, "temperature": 1.0, "logprobs": 0}}
        for q in questions
    ],
}
FAST = "shared SamplingParams"


async def one(pkg, url, specs):
    q = f"ab-{uuid.uuid4().hex[:8]}"
    p = pkg.Producer(url, q)
    await p.connect()
    c = connect(url)
    await c.config_resetstat()
    i0 = await c.info("cpu")
    t0, c0 = time.perf_counter(), time.process_time()
    hs = await p.submit_many(specs)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    i1 = await c.info("cpu")
    st = (await c.info("commandstats")).get("cmdstat_evalsha", {})
    await c.aclose()
    rc = (i1["used_cpu_user"] + i1["used_cpu_sys"]) - (i0["used_cpu_user"] + i0["used_cpu_sys"])
    assert len(hs) == len(specs)
    await p.close()
    c = connect(url)
    keys = [k async for k in c.scan_iter(f"rollq:{{{q}}}:*")]
    if keys:
        await c.delete(*keys)
    await c.aclose()
    n = len(specs)
    return n / dt, 1e6 * dc / n, 1e6 * rc / n, st.get("usec", 0) / n


async def main():
    srv = RedisServer()
    srv.start()
    res = {shape: {side: [] for side in SIDES} for shape in SHAPES}
    try:
        for side, pkg in SIDES.items():  # warm up both, every shape
            for make in SHAPES.values():
                await one(pkg, srv.url, make(side)[:2000])
        for r in range(REPS):
            for shape, make in SHAPES.items():
                order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
                for side in order:
                    specs = make(side)
                    res[shape][side].append(await one(SIDES[side], srv.url, specs))
    finally:
        srv.cleanup()
    med = {shape: {side: statistics.median(x[0] for x in res[shape][side]) for side in SIDES} for shape in SHAPES}
    for shape in SHAPES:
        for side in SIDES:
            rows = res[shape][side]
            print(f"{shape}: {side:6} {med[shape][side]:,.0f} jobs/s median, producer CPU median "
                  f"{statistics.median(x[1] for x in rows):.2f} us/job, redis CPU median {statistics.median(x[2] for x in rows):.2f} "
                  f"us/job, SUBMIT script median {statistics.median(x[3] for x in rows):.2f} us/job (commandstats)")
        h, n = [x[0] for x in res[shape]["before"]], [x[0] for x in res[shape]["after"]]
        row = {"shape": shape, "before_jobs_s": [round(x) for x in h], "after_jobs_s": [round(x) for x in n],
               "ratio_median": round(med[shape]["after"] / med[shape]["before"], 3), "ratio_best": round(max(n) / max(h), 3),
               "share_of_fast_path": [round(med[shape][side] / med[FAST][side], 3) for side in SIDES],
               "producer_us_per_job": [round(statistics.median(x[1] for x in res[shape][k]), 2) for k in SIDES],
               "redis_us_per_job": [round(statistics.median(x[2] for x in res[shape][k]), 2) for k in SIDES]}
        OUT.append(row)
        print(json.dumps(row))
    Path(A.out).parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/submit_ab.py " + " ".join(sys.argv[1:])
    Path(A.out + ".json").write_text(json.dumps({"command": cmd, "before": A.before, "jobs": N, "reps": REPS, "rows": OUT}, indent=2) + "\n")
    md = [f"# Submit rate, {A.before} against the working tree", "", f"`{cmd}`", "",
          "| shape | before jobs/s (median) | after jobs/s (median) | after/before median | best | share of the fast path before/after | producer us/job before/after | redis us/job before/after |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in OUT:
        md.append(f"| {r['shape']} | {statistics.median(r['before_jobs_s']):,.0f} | {statistics.median(r['after_jobs_s']):,.0f} | "
                  f"{r['ratio_median']} | {r['ratio_best']} | {r['share_of_fast_path'][0]} / {r['share_of_fast_path'][1]} | "
                  f"{r['producer_us_per_job'][0]} / {r['producer_us_per_job'][1]} | {r['redis_us_per_job'][0]} / {r['redis_us_per_job'][1]} |")
    Path(A.out + ".md").write_text("\n".join(md) + "\n")


OUT: list = []
if __name__ == "__main__":
    asyncio.run(main())
