"""``rollq demo``: the whole path on one machine.

An embedded redis-server, one or more replicas (vLLM on a tiny locally built model, or the
echo engine), a producer that submits GRPO groups with a progress bar, and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

log = logging.getLogger("rollq.demo")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


async def _make_engines(a: argparse.Namespace) -> list[Any]:
    from .consumer.engine import EchoEngine

    if a.engine == "echo":
        return [EchoEngine(delay_per_token=0.0005) for _ in range(a.replicas)]
    from .consumer.vllm_engine import VllmEngine, VllmEngineConfig
    from .testing.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    engines = [VllmEngine(VllmEngineConfig(model=model, seed=i)) for i in range(a.replicas)]
    return engines


def _prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    topics = ["arithmetic", "geometry", "poetry", "chemistry", "history", "music", "code", "logic"]
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        msg = f"Problem {i} ({rng.choice(topics)}): what is {a} plus {b}? Think step by step."
        out.append({"messages": [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": msg}]})
    return out


async def demo(a: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .consumer.loop import Consumer
    from .producer.client import Producer
    from .server import RedisServer
    from .settings import ConsumerSettings

    console = Console(stderr=True)
    with RedisServer() as srv:
        console.print(f"[bold]redis[/] {srv.url}")
        with console.status(f"starting {a.replicas} {a.engine} replica(s)..."):
            t0 = time.perf_counter()
            engines = await _make_engines(a)
            await asyncio.gather(*(e.start() for e in engines))
            start_s = time.perf_counter() - t0
        console.print(f"[bold]{a.replicas} {a.engine} replica(s)[/] ready in {start_s:.1f}s ({engines[0].model})")
        consumers = [
            Consumer(e, srv.url, "demo", consumer_id=f"replica-{i}", settings=ConsumerSettings(lease_ttl=5.0))
            for i, e in enumerate(engines)
        ]
        tasks = [asyncio.create_task(c.run()) for c in consumers]
        results = []
        async with Producer(srv.url, "demo", producer_id="demo-trainer") as p:
            specs = _prompts(a.prompts)
            sampling = {"max_tokens": a.max_tokens, "n": a.group_size, "temperature": 1.0, "logprobs": 0, "seed": None}
            t_submit = time.perf_counter()
            await p.submit_many([dict(s, sampling=sampling) for s in specs])
            with Progress(
                TextColumn("[bold]rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            ) as prog:
                task = prog.add_task("results", total=a.prompts)
                async for r in p.results(timeout=600):
                    results.append(r)
                    prog.advance(task)
                    if len(results) >= a.prompts:
                        break
            wall = time.perf_counter() - t_submit
        for c in consumers:
            c.stop()
        await asyncio.gather(*tasks)
        await asyncio.gather(*(e.stop() for e in engines))

    ok = [r for r in results if r.error is None]
    tokens = sum(len(s.tokens) // 4 for r in ok for s in r.samples)
    lat_ms = [(r.finished - r.submitted) * 1000 for r in ok]
    share = Counter(r.replica for r in ok)
    versions = sorted({v for r in ok for v in (r.version_start, r.version_end)})
    return {
        "engine": a.engine,
        "model": engines[0].model,
        "jobs": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "samples": sum(len(r.samples) for r in ok),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "p50_ms": round(_percentile(lat_ms, 0.50), 1),
        "p99_ms": round(_percentile(lat_ms, 0.99), 1),
        "mean_ms": round(statistics.fmean(lat_ms), 1) if lat_ms else 0.0,
        "replicas": {k: share.get(k, 0) for k in sorted(c.id for c in consumers)},
        "versions": versions,
        "engine_start_s": round(start_s, 1),
    }


def run_demo(a: argparse.Namespace) -> int:
    summary = asyncio.run(demo(a))
    if a.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="rollq demo", show_header=False)
        for k, v in summary.items():
            t.add_row(k, str(v))
        Console().print(t)
    return 0 if summary["ok"] == summary["jobs"] == a.prompts else 1
