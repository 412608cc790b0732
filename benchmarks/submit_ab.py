"""Submit rate before and after a change of the producer: the client and SUBMIT script of a
git revision against the working tree's, one redis-server, alternating, in one run.

    python benchmarks/submit_ab.py [--before REV] [--jobs 20000] [--reps 7] [--out benchmarks/results/submit_ab]

Two spec shapes: token prompts sharing one SamplingParams (the fast path), and dicts with a
per-job ``"sampling": {...}``. Reports jobs/s (wall), producer CPU and Redis CPU per job.
"""
import argparse, asyncio, hashlib, importlib.util, json, os, random, statistics, subprocess, sys, tempfile, time, uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollq.connection import Script, connect  # noqa: E402
from rollq.protocol import SamplingParams  # noqa: E402
from rollq.server import RedisServer  # noqa: E402
from rollq.producer.client import Producer as NewProducer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--before", default="37ee1dc~1", help="git revision of the 'before' client (default: before idempotent calls)")
ap.add_argument("--jobs", type=int, default=20000)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--out", default="benchmarks/results/submit_ab")
A = ap.parse_args()
N, REPS = A.jobs, A.reps
_tmp = tempfile.mkdtemp(prefix="rollq-ab-")
_root = Path(__file__).resolve().parents[1]
for src, dst in (("rollq/producer/client.py", "client_before.py"), ("rollq/lua/submit.lua", "submit_before.lua")):
    Path(_tmp, dst).write_bytes(subprocess.run(["git", "show", f"{A.before}:{src}"], cwd=_root, check=True, capture_output=True).stdout)
spec = importlib.util.spec_from_file_location("rollq.producer._client_before", os.path.join(_tmp, "client_before.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
old_script = Script("submit")
old_script.source = Path(_tmp, "submit_before.lua").read_text()
old_script.sha = hashlib.sha1(old_script.source.encode()).hexdigest().encode()
old.SUBMIT = old_script  # the HEAD client runs HEAD's script
OldProducer = old.Producer

rng = random.Random(7)
prompts = [[rng.randrange(1, 50000) for _ in range(rng.randrange(32, 256))] for _ in range(N)]
sp = SamplingParams(max_tokens=16)
SHAPES = {
    "shared SamplingParams": lambda: [{"prompt_token_ids": p, "sampling": sp} for p in prompts],
    "per-job sampling dict": lambda: [{"prompt_token_ids": p, "sampling": {"max_tokens": 16, "temperature": 1.0}} for p in prompts],
}


async def one(cls, url, specs):
    q = f"ab-{uuid.uuid4().hex[:8]}"
    p = cls(url, q)
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
    assert len(hs) == N
    await p.close()
    c = connect(url)
    keys = [k async for k in c.scan_iter(f"rollq:{{{q}}}:*")]
    if keys:
        await c.delete(*keys)
    await c.aclose()
    return N / dt, 1e6 * dc / N, 1e6 * rc / N, st.get("usec", 0) / N


async def main():
    srv = RedisServer()
    srv.start()
    try:
        c = connect(srv.url)
        await c.script_load(old_script.source)
        await c.aclose()
        for cls in (OldProducer, NewProducer):  # warm up both
            await one(cls, srv.url, SHAPES["shared SamplingParams"]()[:2000] * 10)
        for shape, make in SHAPES.items():
            res = {"before": [], "after": []}
            for r in range(REPS):
                order = [("before", OldProducer), ("after", NewProducer)]
                if r % 2:
                    order.reverse()
                for name, cls in order:
                    specs = make()
                    res[name].append(await one(cls, srv.url, specs))
            for name in res:
                cpu = [x[1] for x in res[name]]; rcpu = [x[2] for x in res[name]]; us = [x[3] for x in res[name]]
                print(f"{shape}: {name:6} producer CPU median {statistics.median(cpu):.2f} us/job, redis CPU median {statistics.median(rcpu):.2f} us/job, SUBMIT script median {statistics.median(us):.2f} us/job (commandstats)")
            h, n = [x[0] for x in res["before"]], [x[0] for x in res["after"]]
            row = {"shape": shape, "before_jobs_s": [round(x) for x in h], "after_jobs_s": [round(x) for x in n],
                   "ratio_median": round(statistics.median(n) / statistics.median(h), 3), "ratio_best": round(max(n) / max(h), 3),
                   "producer_us_per_job": [round(statistics.median([x[1] for x in res[k]]), 2) for k in ("before", "after")],
                   "redis_us_per_job": [round(statistics.median([x[2] for x in res[k]]), 2) for k in ("before", "after")]}
            OUT.append(row)
            print(json.dumps(row))
    finally:
        srv.cleanup()
    Path(A.out).parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/submit_ab.py " + " ".join(sys.argv[1:])
    Path(A.out + ".json").write_text(json.dumps({"command": cmd, "before": A.before, "jobs": N, "reps": REPS, "rows": OUT}, indent=2) + "\n")
    md = [f"# Submit rate, {A.before} against the working tree", "", f"`{cmd}`", "",
          "| shape | before jobs/s (median) | after jobs/s (median) | after/before median | best | producer us/job before/after | redis us/job before/after |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in OUT:
        md.append(f"| {r['shape']} | {statistics.median(r['before_jobs_s']):,.0f} | {statistics.median(r['after_jobs_s']):,.0f} | "
                  f"{r['ratio_median']} | {r['ratio_best']} | {r['producer_us_per_job'][0]} / {r['producer_us_per_job'][1]} | "
                  f"{r['redis_us_per_job'][0]} / {r['redis_us_per_job'][1]} |")
    Path(A.out + ".md").write_text("\n".join(md) + "\n")


OUT: list = []
if __name__ == "__main__":
    asyncio.run(main())
