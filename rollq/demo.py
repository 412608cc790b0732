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
    ext = "rollq.weightsync.worker_ext.RollqWorkerExtension"
    return [VllmEngine(VllmEngineConfig(model=model, seed=i, max_model_len=1024, worker_extension_cls=ext)) for i in range(a.replicas)]


def _new_policy(engine: Any, step: int) -> dict[str, Any]:
    """The trainer's "next policy": the tiny model's weights, perturbed (echo: a dummy tensor)."""
    import torch

    if getattr(engine, "name", "") != "vllm":
        return {"dummy": torch.full((4,), float(step))}
    import os

    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(os.listdir(engine.model)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(engine.model, f)))
    g = torch.Generator().manual_seed(step)
    return {k: v + torch.randn(v.shape, generator=g, dtype=v.dtype) * 0.5 for k, v in state.items()}


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
    import tempfile

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .consumer.loop import Consumer
    from .producer.client import Producer
    from .server import RedisServer
    from .settings import ConsumerSettings
    from .weightsync.follower import WeightFollower
    from .weightsync.publisher import WeightPublisher

    console = Console(stderr=True)
    weights_root = tempfile.mkdtemp(prefix="rollq-demo-weights-")
    probe = {"prompt_token_ids": [11, 42, 7, 300, 5, 99, 17, 3], "sampling": {"max_tokens": 12, "temperature": 0.0}}
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
        followers = [WeightFollower(c, root=weights_root, reconcile_interval=1.0) for c in consumers]
        for f in followers:
            await f.start()
        tasks = [asyncio.create_task(c.run()) for c in consumers]
        publisher = WeightPublisher(srv.url, "demo", root=weights_root, trainer_id="demo-trainer")
        results = []
        update: dict[str, Any] = {}
        async with Producer(srv.url, "demo", producer_id="demo-trainer") as p:
            await p.set_update_policy("keep")
            before = await (await p.submit(**probe)).result(timeout=120)
            new_state = _new_policy(engines[0], 1)  # the trainer's next policy, computed up front
            specs = _prompts(a.prompts)
            sampling = {"max_tokens": a.max_tokens, "n": a.group_size, "temperature": 1.0, "logprobs": 0}
            first, second = specs[: a.prompts // 2], specs[a.prompts // 2 :]
            t_submit = time.perf_counter()
            # Step 0's rollouts; halfway through them the trainer publishes policy version 1
            # (in-flight jobs continue on it: policy "keep"), then submits step 1's rollouts.
            await p.submit_many([dict(s, sampling=sampling) for s in first])
            with Progress(
                TextColumn("[bold]rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            ) as prog:
                task = prog.add_task("results", total=a.prompts)
                async for r in p.results(timeout=600):
                    results.append(r)
                    prog.advance(task)
                    if len(results) >= len(first) // 2 and not update:
                        t_pub = time.perf_counter()
                        rec = await publisher.publish_weights(new_state)
                        while not all(f.history and f.history[-1].version >= rec.version for f in followers):
                            await asyncio.sleep(0.005)
                        update = {
                            "version": rec.version, "weight_update_s": time.perf_counter() - t_pub,
                            "publish_s": rec.timings.get("total_s", 0.0),
                            "pause_s": max(f.history[-1].pause_s for f in followers),
                        }
                        prog.console.print(
                            f"published policy version {rec.version}: every replica serving it "
                            f"{update['weight_update_s']:.3f}s later (generation paused {update['pause_s'] * 1000:.1f} ms at most)"
                        )
                        await p.submit_many([dict(s, sampling=sampling) for s in second])
                    if len(results) >= a.prompts:
                        break
            wall = time.perf_counter() - t_submit
            after = await (await p.submit(**probe)).result(timeout=120)
        for c in consumers:
            c.stop()
        await asyncio.gather(*tasks)
        for f in followers:
            await f.stop()
        await publisher.close()
        await asyncio.gather(*(e.stop() for e in engines))
    import shutil

    shutil.rmtree(weights_root, ignore_errors=True)

    ok = [r for r in results if r.error is None]
    tokens = sum(len(s.tokens) // 4 for r in ok for s in r.samples)
    lat_ms = [(r.finished - r.submitted) * 1000 for r in ok]
    share = Counter(r.replica for r in ok)
    versions = sorted({v for r in ok for v in (r.version_start, r.version_end)})
    spans = Counter(f"{r.version_start}->{r.version_end}" if r.version_start != r.version_end else str(r.version_start) for r in ok)
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
        "replicas": {k: share.get(k, 0) for k in sorted(c.id for c in consumers)},
        "versions": versions,
        "jobs_by_version": dict(sorted(spans.items())),
        "weight_update_s": round(update.get("weight_update_s", 0.0), 4),
        "pause_s": round(update.get("pause_s", 0.0), 4),
        "greedy_before": before.samples[0].token_ids,
        "greedy_after": after.samples[0].token_ids,
        "greedy_changed": before.samples[0].token_ids != after.samples[0].token_ids,
        "engine_start_s": round(start_s, 1),
    }


def run_demo(a: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
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
    good = summary["ok"] == summary["jobs"] == a.prompts and len(summary["versions"]) >= 2
    return 0 if good else 1
