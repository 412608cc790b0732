"""Drive one peer against a given Redis: enqueue rate, bytes per queued job, drain rate with
ONE worker process of the peer's own, and (optionally) the single-job round trip.

Run from ``benchmarks/`` (``python -m peers.run_peer --peer rq --url ... --jobs 5000 --out x.json``);
``queue_bench.py`` does that, one peer at a time, in a fresh process tree. The Redis database
is flushed first; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis

BENCH_DIR = Path(__file__).resolve().parent.parent


def mem_info(r: redis.Redis) -> dict:
    m = r.info("memory")
    used = int(m["used_memory"])
    clients = int(m.get("mem_clients_normal", 0))
    aof = int(m.get("mem_aof_buffer", 0))
    return {"used_memory": used, "mem_clients_normal": clients, "mem_aof_buffer": aof, "data": used - clients - aof}


def settle_mem(r: redis.Redis, wait: float = 0.3) -> dict:
    time.sleep(wait)
    return mem_info(r)


def keyspace(r: redis.Redis, limit: int = 20) -> dict:
    """Key count and a per-type summary (sampled names)."""
    n = r.dbsize()
    types: dict[str, int] = {}
    names: list[str] = []
    for k in r.scan_iter(count=1000):
        t = r.type(k).decode()
        types[t] = types.get(t, 0) + 1
        if len(names) < limit:
            names.append(k.decode(errors="replace"))
    return {"keys": n, "types": types, "sample": names}


def make_jobs(n: int, seed: int = 7) -> list[tuple[list[int], int]]:
    rnd = random.Random(seed)
    return [([rnd.randrange(32000) for _ in range(50)], 16) for _ in range(n)]


def call(fn, *a):
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(*a))
    return fn(*a)


def read_done(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def start_worker(mod, url: str, burst: bool, env_extra: dict, log_path: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(env_extra)
    env["BENCH_REDIS_URL"] = url
    env["PYTHONPATH"] = str(BENCH_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    log = open(log_path, "ab")
    return subprocess.Popen(
        mod.worker_cmd(url, burst), cwd=str(BENCH_DIR), env=env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )


def stop_worker(p: subprocess.Popen, grace: float = 10.0) -> int | None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    else:  # burst worker exited; make sure no child of it is left
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode


def tail(path: str, n: int = 1500) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run(peer: str, url: str, n: int, rt: int, drain_timeout: float, rt_timeout: float) -> dict:
    os.environ["BENCH_REDIS_URL"] = url  # peer modules read it at import
    mod = importlib.import_module(f"peers.{peer}_peer")
    out: dict = {"peer": peer, "jobs": n, "notes": mod.NOTES}
    r = redis.Redis.from_url(url)
    r.flushall()
    jobs = make_jobs(n)
    tmp = tempfile.mkdtemp(prefix=f"bench-{peer}-")
    log_path = os.path.join(tmp, "worker.log")

    # -- enqueue ---------------------------------------------------------------------------
    r.slowlog_reset()  # slowlog entries count in used_memory: cleared before each snapshot
    m0 = settle_mem(r, 0.2)
    c0 = time.process_time()
    t0 = time.perf_counter()
    call(mod.enqueue, url, jobs)
    t1 = time.perf_counter()
    out["enqueue_cpu_us_per_job"] = 1e6 * (time.process_time() - c0) / n
    out["enqueue_s"] = t1 - t0
    out["enqueue_jobs_per_s"] = n / (t1 - t0)
    out["slowlog_enqueue"] = len(r.slowlog_get(128))
    r.slowlog_reset()
    m1 = settle_mem(r)
    out["mem_before"] = m0
    out["mem_after_enqueue"] = m1
    out["bytes_per_job"] = (m1["data"] - m0["data"]) / n
    out["bytes_per_job_raw_used_memory"] = (m1["used_memory"] - m0["used_memory"]) / n
    out["keyspace_after_enqueue"] = keyspace(r)

    # -- drain with one worker process --------------------------------------------------------
    done_file = os.path.join(tmp, "done.json")
    w = start_worker(mod, url, True, {"BENCH_DONE_FILE": done_file, "BENCH_N": str(n)}, log_path)
    deadline = time.monotonic() + drain_timeout
    st = None
    while time.monotonic() < deadline:
        st = read_done(done_file)
        if st and st["count"] >= n:
            break
        if w.poll() is not None:  # a burst worker that quit early
            time.sleep(0.1)
            st = read_done(done_file)
            break
        time.sleep(0.02)
    rc = stop_worker(w)
    out["worker_rc"] = rc
    if st and st["count"] > 1 and st["last"] > st["first"]:
        out["drain_count"] = st["count"]
        out["drain_s"] = st["last"] - st["first"]
        done_after_first = st["count"] if st.get("mode") == "start" else st["count"] - 1
        out["drain_jobs_per_s"] = done_after_first / (st["last"] - st["first"])
        out["drain_timing"] = st.get("mode")
        out["drain_complete"] = st["count"] >= n
    else:
        out["drain_complete"] = False
        out["drain_error"] = "no progress recorded: " + tail(log_path)
    if not out["drain_complete"]:
        out["worker_log_tail"] = tail(log_path)
    out["slowlog_drain"] = len(r.slowlog_get(128))
    r.slowlog_reset()
    out["mem_after_drain"] = settle_mem(r, 0.2)
    out["keyspace_after_drain"] = keyspace(r)

    # -- single-job round trip ------------------------------------------------------------------
    if rt > 0 and hasattr(mod, "rt_call"):
        out["round_trip"] = round_trip(mod, url, rt, rt_timeout, log_path)
    r.flushall()
    r.close()
    return out


def round_trip(mod, url: str, count: int, timeout: float, log_path: str) -> dict:
    """Sequential single-job round trips with one non-burst worker running. A call that fails
    (e.g. times out) is counted in ``errors`` and left out of the percentiles."""
    w = start_worker(mod, url, False, {"BENCH_DONE_FILE": ""}, log_path)
    tokens, mt = make_jobs(1, seed=1)[0]
    lat: list[float] = []
    res: dict = {"errors": 0}
    is_async = inspect.iscoroutinefunction(mod.rt_call)

    async def once(ctx) -> float:
        t = time.perf_counter()
        if is_async:
            await mod.rt_call(ctx, tokens, mt)
        else:
            mod.rt_call(ctx, tokens, mt)
        return (time.perf_counter() - t) * 1000

    async def body() -> None:
        ctx = (await mod.rt_open(url)) if is_async else mod.rt_open(url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:  # the worker is starting up
                try:
                    await once(ctx)
                    break
                except Exception as e:  # noqa: BLE001
                    res["startup_error"] = repr(e)[:300]
            for i in range(count + 20):
                if time.monotonic() > deadline:
                    res["timed_out"] = True
                    break
                try:
                    dt = await once(ctx)
                except Exception as e:  # noqa: BLE001
                    res["errors"] += 1
                    res.setdefault("first_error", repr(e)[:300])
                    continue
                if i >= 20:  # 20 warm-up calls
                    lat.append(dt)
        finally:
            if is_async:
                await mod.rt_close(ctx)
            else:
                mod.rt_close(ctx)

    try:
        asyncio.run(body())
    except Exception as e:  # noqa: BLE001
        res["error"] = repr(e)[:500]
    finally:
        stop_worker(w)
    if lat:
        lat.sort()
        res.update(
            count=len(lat), p50_ms=statistics.median(lat), p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            mean_ms=statistics.fmean(lat),
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--rt", type=int, default=300, help="single-job round trips (0: skip)")
    ap.add_argument("--drain-timeout", type=float, default=90.0)
    ap.add_argument("--rt-timeout", type=float, default=30.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        res = run(a.peer, a.url, a.jobs, a.rt, a.drain_timeout, a.rt_timeout)
    except Exception as e:  # noqa: BLE001
        import traceback

        res = {"peer": a.peer, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
