"""Where rollq's producer and consumer spend their time, and what leaner paths would gain.

    python benchmarks/profile_hotpaths.py [--jobs 20000] [--out benchmarks/results/profile_hotpaths]

Companion of ``queue_bench.py`` (read its results first). Three parts, on its own
``redis-server`` (same config as queue_bench):

1. per-job CPU of each piece of the hot paths, no Redis (best of 3): ``build_job`` and its
   parts, ``encode_job``/``decode_job``, ``EchoEngine.generate_now``, result encoding, and
   redis-py's packing of a FINISH call (7 arguments per job) against one msgpack blob;
2. submit: ``Producer.submit_many`` against prototypes that use the SAME ``submit.lua``
   (A: jobs built directly, the shared SamplingParams validated once; B: A + all chunks in
   one pipeline) and a prototype with a blob script (C: A + one msgpack argument per chunk,
   unpacked by ``cmsgpack`` in Lua);
3. dispatch: ``Consumer(EchoEngine).run(burst=True)`` against a lean loop prototype (raw
   XREADGROUP reply, decode without re-validation, echo by byte slicing, one blob FINISH per
   batch doing the same XACK + XDEL + HDEL + XADD result + HINCRBY).

The prototypes only exist here, to size the suggested changes; rollq itself is not modified.
Every figure is jobs/s plus CPU microseconds per job of the Python process and of
redis-server (``INFO cpu``), which hold better than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import time
from array import array
from pathlib import Path

import msgpack
import msgspec
import redis

BENCH_DIR = Path(__file__).resolve().parent
QUEUE = "prof"
N_DEFAULT = 20000

SUBMIT_BLOB_LUA = """
-- prototype of submit.lua taking ONE argument: msgpack array [jid1, payload1, jid2, payload2, ...]
-- (without the admission-control prelude of the current submit.lua: an HMGET on an unset config)
local a = cmsgpack.unpack(ARGV[1])
local dup = {}
local n = 0
for i = 1, #a, 2 do
  if redis.call('HSETNX', KEYS[2], a[i], 'q') == 1 then
    redis.call('XADD', KEYS[1], '*', 'd', a[i + 1])
    n = n + 1
  else
    dup[#dup + 1] = a[i]
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], 'submitted', n) end
return dup
"""

FINISH_BLOB_LUA = """
-- prototype of finish.lua for the common case (completed, one result stream per call):
-- KEYS: source stream, ids hash, stats hash, result stream; ARGV[1] group, ARGV[2] ttl ms,
-- ARGV[3] msgpack array of [entry id, job id, result payload] rows
local rows = cmsgpack.unpack(ARGV[3])
local out = {}
local n = 0
for i = 1, #rows do
  local r = rows[i]
  if redis.call('XACK', KEYS[1], ARGV[1], r[1]) == 1 then
    redis.call('XDEL', KEYS[1], r[1])
    redis.call('HDEL', KEYS[2], r[2])
    redis.call('XADD', KEYS[4], '*', 'd', r[3])
    n = n + 1
    out[i] = 1
  else
    out[i] = 0
  end
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
  redis.call('HINCRBY', KEYS[3], 'completed', n)
end
return out
"""


def redis_cpu(r: redis.Redis) -> float:
    c = r.info("cpu")
    return float(c["used_cpu_user"]) + float(c["used_cpu_sys"])


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(32000) for _ in range(50)] for _ in range(n)]


# ------------------------------------------------------------------------------------------
# 1. per-job CPU, no Redis
# ------------------------------------------------------------------------------------------
def micro(n: int) -> dict:
    from redis._parsers.encoders import Encoder
    from redis.asyncio.connection import Connection

    from rollq.consumer.engine import EchoEngine
    from rollq.consumer.loop import LATENCY_BUCKETS_MS, _bucket
    from rollq.producer.client import Producer
    from rollq.protocol import (
        Job, Result, SamplingParams, decode_job, encode_job, encode_result, pack_i32, validate_job,
    )

    sp = SamplingParams(max_tokens=16)
    p = Producer("redis://127.0.0.1:1/0", QUEUE, producer_id="prof")
    ps = prompts(n)
    specs = [{"prompt_token_ids": t, "sampling": sp} for t in ps]
    out: dict[str, float] = {}

    def t(name: str, fn, count: int = n):
        best = 1e9
        res = None
        for _ in range(3):
            t0 = time.process_time()
            res = fn()
            best = min(best, time.process_time() - t0)
        out[name] = 1e6 * best / count
        return res

    jobs = t("producer: build_job (spec dict -> validated Job)", lambda: [p.build_job(s) for s in specs])
    t("producer:   SamplingParams.from_dict(shared sp) = validate()", lambda: [SamplingParams.from_dict(sp) for _ in range(n)])
    t("producer:   pack_i32(list of 50 ints)", lambda: [pack_i32(x) for x in ps])
    t("producer:   array('i', list).tobytes() (fast path)", lambda: [array("i", x).tobytes() for x in ps])
    t("producer:   validate_job(job) (validates sampling again)", lambda: [validate_job(j) for j in jobs])
    t("producer:   Job(...) built directly, sp validated once", lambda: [
        Job(id=f"prof-{i:x}", reply="prof", tokens=array("i", x).tobytes(), sampling=sp, submitted=1.0) for i, x in enumerate(ps)])
    payloads = t("both: encode_job", lambda: [encode_job(j) for j in jobs])
    t("consumer: decode_job (decode + validate_job)", lambda: [decode_job(b) for b in payloads])
    dec = msgspec.msgpack.Decoder(Job)
    t("consumer:   msgspec decode only", lambda: [dec.decode(b) for b in payloads])
    e = EchoEngine()
    outs = t("consumer: EchoEngine.generate_now", lambda: [e.generate_now(j) for j in jobs])

    def echo_bytes():
        res = []
        for j in jobs:
            k = 4 * j.sampling.max_tokens
            tok = j.tokens
            res.append((tok * (k // len(tok) + 1))[:k])
        return res

    t("consumer:   echo by byte slicing (sample 0)", echo_bytes)

    def results():
        return [encode_result(Result(id=j.id, samples=o.samples, prompt_tokens=o.prompt_tokens, replica="c", submitted=j.submitted,
                                     started=1.0, finished=2.0, meta=j.meta)) for j, o in zip(jobs, outs)]

    res_payloads = t("consumer: Result(...) + encode_result", results)
    t("consumer: _bucket(latency) (linear scan)", lambda: [_bucket(3.0) for _ in range(n)])
    t("consumer:   bisect.bisect_left", lambda: [bisect.bisect_left(LATENCY_BUCKETS_MS, 3.0) for _ in range(n)])

    conn = Connection.__new__(Connection)
    conn.encoder = Encoder("utf-8", "strict", False)
    conn._buffer_cutoff = 6000
    batch = 1024
    args: list = []
    for j, rp in zip(jobs[:batch], res_payloads[:batch]):
        args += [4, b"1700000000000-1", j.id, 5, rp, b"", "completed"]
    reps = max(1, n // batch)

    def pack7():
        for _ in range(reps):
            conn.pack_command("EVALSHA", "a" * 40, 5, "k1", "k2", "k3", "k4", "k5", "rollq", 86400000, 100000, *args)

    t("consumer: redis-py packs FINISH, 7 args per job", pack7, count=reps * batch)
    rows = [(b"1700000000000-1", j.id, rp) for j, rp in zip(jobs[:batch], res_payloads[:batch])]

    def pack_blob():
        for _ in range(reps):
            conn.pack_command("EVALSHA", "a" * 40, 4, "k1", "k2", "k3", "k4", "rollq", 86400000,
                              msgpack.packb(rows, use_bin_type=False))

    t("consumer:   one msgpack blob per FINISH (packb + pack_command)", pack_blob, count=reps * batch)
    return out


# ------------------------------------------------------------------------------------------
# 2. submit
# ------------------------------------------------------------------------------------------
async def submit_variants(url: str, r: redis.Redis, n: int) -> dict:
    from rollq.connection import SUBMIT, connect, load_scripts
    from rollq.keys import QueueKeys
    from rollq.producer.client import Producer
    from rollq.protocol import Job, SamplingParams, encode_job

    ps = prompts(n)
    sp = SamplingParams(max_tokens=16)
    c = connect(url)
    await load_scripts(c)
    blob_sha = await c.script_load(SUBMIT_BLOB_LUA)
    out = {}

    async def measure(name: str, fn) -> None:
        r.flushdb()
        await asyncio.sleep(0.2)
        rc0, c0, t0 = redis_cpu(r), time.process_time(), time.perf_counter()
        await fn()
        t1, c1, rc1 = time.perf_counter(), time.process_time(), redis_cpu(r)
        k = QueueKeys(QUEUE)
        assert r.xlen(k.jobs) == n, (name, r.xlen(k.jobs))
        out[name] = {"jobs_per_s": n / (t1 - t0), "python_cpu_us_per_job": 1e6 * (c1 - c0) / n,
                     "redis_cpu_us_per_job": 1e6 * (rc1 - rc0) / n}

    p = Producer(url, QUEUE, producer_id="prof")
    await p.connect()

    async def current():
        await p.submit_many([{"prompt_token_ids": x, "sampling": sp} for x in ps])

    keys = QueueKeys(QUEUE)
    # the producer's own key list for submit.lua (it grew admission-control keys)
    skeys = keys.submit_keys(keys.jobs) if hasattr(keys, "submit_keys") else [keys.jobs, keys.ids, keys.stats]
    chunk = 2000
    seq = [0]

    def build_args(lo: int, hi: int) -> list:
        now = time.time()
        sp.validate()  # once per chunk, not twice per job
        args: list = []
        for x in ps[lo:hi]:
            seq[0] += 1
            jid = f"prof-{seq[0]:x}"
            args.append(jid)
            args.append(encode_job(Job(id=jid, reply="prof", tokens=array("i", x).tobytes(), sampling=sp, submitted=now)))
        return args

    def submit_args(lo: int, hi: int) -> list:  # submit.lua's arguments: one msgpack array, the producer id
        return [msgpack.packb(build_args(lo, hi), use_bin_type=False), "prof"]

    async def proto_a():
        for lo in range(0, n, chunk):
            await SUBMIT(c, skeys, submit_args(lo, lo + chunk))

    async def proto_b():
        pipe = c.pipeline(transaction=False)
        for lo in range(0, n, chunk):
            pipe.evalsha(SUBMIT.sha, len(skeys), *skeys, *submit_args(lo, lo + chunk))
        await pipe.execute()

    async def proto_c():
        pipe = c.pipeline(transaction=False)
        for lo in range(0, n, chunk):
            pipe.evalsha(blob_sha, 3, keys.jobs, keys.ids, keys.stats, msgpack.packb(build_args(lo, lo + chunk), use_bin_type=False))
        await pipe.execute()

    for _ in range(2):  # best of 2 runs each, interleaved
        for name, fn in (("Producer.submit_many (current)", current), ("A: direct Job build, sp validated once", proto_a),
                         ("B: A + all chunks pipelined", proto_b), ("C: B + one msgpack arg per chunk (blob Lua)", proto_c)):
            prev = out.get(name)
            await measure(name, fn)
            if prev and prev["jobs_per_s"] > out[name]["jobs_per_s"]:
                out[name] = prev
    await p.close()
    await c.aclose()
    r.flushdb()
    return out


# ------------------------------------------------------------------------------------------
# 3. dispatch
# ------------------------------------------------------------------------------------------
async def fill_queue(url: str, n: int, producer_id: str) -> None:
    from rollq.producer.client import Producer
    from rollq.protocol import SamplingParams

    sp = SamplingParams(max_tokens=16)
    p = Producer(url, QUEUE, producer_id=producer_id)
    await p.connect()
    await p.submit_many([{"prompt_token_ids": x, "sampling": sp} for x in prompts(n)])
    await p.close()


async def drain_current(url: str, r: redis.Redis, n: int) -> dict:
    from rollq.consumer.engine import EchoEngine
    from rollq.consumer.loop import Consumer
    from rollq.settings import ConsumerSettings

    c = Consumer(EchoEngine(), url, QUEUE, consumer_id="prof-cur",
                 settings=ConsumerSettings(max_inflight=4096, initial_inflight=4096, batch=1024))
    c.intake_gate.clear()
    task = asyncio.create_task(c.run(burst=True))
    while c.state != "serving":
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.2)
    rc0, c0, t0 = redis_cpu(r), time.process_time(), time.perf_counter()
    c.intake_gate.set()
    while c.counters.completed < n and not task.done():
        await asyncio.sleep(0.001)
    t1, c1, rc1 = time.perf_counter(), time.process_time(), redis_cpu(r)
    await task
    return {"jobs_per_s": n / (t1 - t0), "python_cpu_us_per_job": 1e6 * (c1 - c0) / n,
            "redis_cpu_us_per_job": 1e6 * (rc1 - rc0) / n, "completed": c.counters.completed}


async def drain_lean(url: str, r: redis.Redis, n: int, *, validate: bool, overlap: bool) -> dict:
    """Lean loop prototype: what the consumer path costs without per-job Python overheads."""
    import redis.asyncio as aredis

    from rollq.keys import GROUP, QueueKeys
    from rollq.protocol import Job, Result, Sample, encode_result, validate_job

    keys = QueueKeys(QUEUE)
    cl = aredis.Redis.from_url(url)
    cl.set_response_callback("XREADGROUP", lambda resp, **kw: resp)  # raw reply: no per-entry dict
    fin = aredis.Redis.from_url(url)
    try:
        await cl.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    sha = await fin.script_load(FINISH_BLOB_LUA)
    dec = msgspec.msgpack.Decoder(Job)
    done = 0
    pending: asyncio.Task | None = None
    rc0, c0, t0 = redis_cpu(r), time.process_time(), time.perf_counter()
    while done < n:
        resp = await cl.execute_command("XREADGROUP", "GROUP", GROUP, "lean", "COUNT", 1024, "BLOCK", 100,
                                        "STREAMS", keys.jobs, ">")
        if not resp:
            continue
        rows = []
        result_key = None
        now = time.time()
        entries = next(iter(resp.values())) if isinstance(resp, dict) else resp[0][1]  # RESP3 map or RESP2 list
        for eid, fields in entries:
            job = dec.decode(fields[1])
            if validate:
                validate_job(job)
            k = 4 * job.sampling.max_tokens
            tok = job.tokens
            res = Result(id=job.id, samples=[Sample(tokens=(tok * (k // len(tok) + 1))[:k], finish_reason="length")],
                         prompt_tokens=len(tok) // 4, replica="lean", submitted=job.submitted, started=now,
                         finished=now, meta=job.meta)
            rows.append((eid, job.id, encode_result(res)))
            result_key = keys.results(job.reply)
        call = fin.evalsha(sha, 4, keys.jobs, keys.ids, keys.stats, result_key, GROUP, 86400000,
                           msgpack.packb(rows, use_bin_type=False))
        if overlap:  # record this batch while pulling the next one
            if pending is not None:
                await pending
            pending = asyncio.ensure_future(call)
        else:
            await call
        done += len(rows)
    if pending is not None:
        await pending
    t1, c1, rc1 = time.perf_counter(), time.process_time(), redis_cpu(r)
    await cl.aclose()
    await fin.aclose()
    return {"jobs_per_s": n / (t1 - t0), "python_cpu_us_per_job": 1e6 * (c1 - c0) / n,
            "redis_cpu_us_per_job": 1e6 * (rc1 - rc0) / n}


async def drain_variants(url: str, r: redis.Redis, n: int) -> dict:
    out: dict = {}
    variants = (
        ("Consumer(EchoEngine).run(burst=True) (current)", lambda: drain_current(url, r, n)),
        ("lean loop, validate_job kept, sequential", lambda: drain_lean(url, r, n, validate=True, overlap=False)),
        ("lean loop, no re-validation, FINISH overlapped with next pull", lambda: drain_lean(url, r, n, validate=False, overlap=True)),
    )
    for _ in range(2):
        for name, fn in variants:
            r.flushdb()
            await fill_queue(url, n, "prof")
            await asyncio.sleep(0.3)
            res = await fn()
            if name not in out or res["jobs_per_s"] > out[name]["jobs_per_s"]:
                out[name] = res
    r.flushdb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=N_DEFAULT)
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "profile_hotpaths"))
    a = ap.parse_args()
    from rollq.server import RedisServer

    res: dict = {"jobs": a.jobs, "loadavg_start": os.getloadavg(), "cpu_count": os.cpu_count()}
    res["micro_us_per_job"] = micro(a.jobs)
    srv = RedisServer(appendfsync="everysec", extra_args=["--auto-aof-rewrite-percentage", "0"])
    srv.start()
    try:
        r = redis.Redis.from_url(srv.url)
        res["submit"] = asyncio.run(submit_variants(srv.url, r, a.jobs))
        res["dispatch"] = asyncio.run(drain_variants(srv.url, r, a.jobs))
        r.close()
    finally:
        srv.cleanup()
    res["loadavg_end"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(res, indent=1))
    L = ["# rollq hot paths: per-job costs and prototypes\n",
         f"N = {a.jobs:,}; {res['cpu_count']} CPUs; load average {res['loadavg_start'][0]:.1f} at start, "
         f"{res['loadavg_end'][0]:.1f} at end. CPU times are process CPU (best of 3 for the micro costs, best of 2 runs for the rest).\n",
         "## Per-job CPU, no Redis\n", "| piece | us / job |", "| --- | --- |"]
    L += [f"| {k} | {v:.2f} |" for k, v in res["micro_us_per_job"].items()]
    for part, title in (("submit", "Submit (one Python producer)"), ("dispatch", "Dispatch (one consumer, null engine)")):
        L += ["", f"## {title}\n", "| variant | jobs/s | Python CPU us/job | redis-server CPU us/job |", "| --- | --- | --- | --- |"]
        L += [f"| {k} | {v['jobs_per_s']:,.0f} | {v['python_cpu_us_per_job']:.1f} | {v['redis_cpu_us_per_job']:.1f} |" for k, v in res[part].items()]
    Path(str(out) + ".md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
