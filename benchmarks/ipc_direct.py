"""Whether a direct swap of a leased IPC version (``WeightSyncSettings.ipc_direct``) shortens an
update against the leased copy into the shadow, in one run.

    python benchmarks/ipc_direct.py [--gib 1] [--layers 8] [--reps 6] [--out benchmarks/results/ipc_direct_cpu]

A replica whose worker runs in this process (``rollq.testing.fake_workers``: the worker
extension's own staging, shadow weights and swap, with a plain model of ``--layers`` float32
linear layers, ``--gib`` in all, instead of vLLM), following a queue on an embedded
redis-server, and a trainer in this process whose weights live in shared memory, leased to the
replica (``WeightPublisher(ipc_lease=True)``). Blocks of updates take turns between the replica
copying each version into its shadow weights while serving and swapping the shadow in
(``lease``), and the swap copying the trainer's tensors straight into the live weights
(``direct``). The first update of each block is not counted: the first traces the load plan,
and the first lease after direct swaps copies live into the shadow before it loads (a direct
swap leaves the shadow behind live), which a replica that keeps one setting never does. Per update: end to
end (the publish call's start to the replica serving the version), the publish call, the
staging, the swap call (generation would stand still for it), and the trainer's
``release_weights`` after it. Results: ``<out>.json`` and ``<out>.md``, with the ratios of the
medians. On a GPU the same comparison is ``benchmarks/gpu_vllm.py --phases ipc --ipc-expose
lease,direct``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_results  # noqa: E402  (beside this script)


class Model(torch.nn.Sequential):
    """Linear layers with vLLM's ``load_weights`` entry point (a plain copy per tensor: the
    shadow traces a load plan from it)."""

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return set(params)


def model(gib: float, layers: int) -> Model:
    d = int((gib * (1 << 30) / 4 / layers) ** 0.5)
    m = Model(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
    for p in m.parameters():
        p.requires_grad_(False)
    return m


async def run(a: argparse.Namespace) -> dict[str, Any]:
    from rollq import Consumer, WeightSyncSettings
    from rollq.replicas import live_replicas
    from rollq.server import RedisServer
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher

    os.environ["ROLLQ_SHADOW_WEIGHTS"] = "1"  # "auto" uses them on GPUs only
    rows: list[dict[str, Any]] = []
    with RedisServer() as srv:
        engine = FakeWorkerEngine(lambda: model(a.gib, a.layers))
        consumer = Consumer(engine, srv.url, "bench", consumer_id="r0")
        follower = WeightFollower(consumer, WeightSyncSettings(reconcile_interval=0.05, load_timeout=120))
        pub = WeightPublisher(srv.url, "bench", ipc_lease=True)
        await follower.start()
        task = asyncio.create_task(consumer.run())
        try:
            deadline = time.monotonic() + 30
            while not await live_replicas(await pub.redis(), consumer.keys):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not register")
                await asyncio.sleep(0.05)
            st = {k: v.clone().share_memory_() for k, v in model(a.gib, a.layers).state_dict().items()}
            nbytes = sum(v.numel() * v.element_size() for v in st.values())
            block = max(1, a.reps // 2)
            order = [(m, k == 0) for _ in range(0, a.reps, block) for m in ("lease", "direct") for k in range(block + 1)]
            for i, (mode, warm) in enumerate(order, start=1):
                follower.settings = dataclasses.replace(follower.settings, ipc_direct=mode == "direct")
                for tr in follower._transports.values():
                    tr.settings = follower.settings
                with torch.no_grad():
                    for v in st.values():
                        v.fill_(float(i))
                t0 = time.perf_counter()
                rec = await pub.publish_weights(st, transport="ipc")
                t_pub = time.perf_counter() - t0
                while consumer.version < rec.version:
                    if time.perf_counter() - t0 > 120:
                        raise RuntimeError(f"version {rec.version} not served")
                    await asyncio.sleep(0.0005)
                e2e = time.perf_counter() - t0
                t1 = time.perf_counter()
                await pub.release_weights(timeout=60)
                release_s = time.perf_counter() - t1
                upd = follower.history[-1]
                p0 = next(iter(engine.workers[0].model_runner.model.parameters()))
                ok = bool((p0 == float(i)).all())
                row = {"mode": mode, "version": rec.version, "end_to_end_s": e2e, "publish_s": t_pub, "release_s": release_s,
                       "stage_call_s": upd.timings.get("stage_call_s"), "swap_call_s": upd.pause_s, "update_s": upd.update_s,
                       "swap": upd.load.get("swap"), "weights_match": ok}
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                if not warm:
                    rows.append(row)
        finally:
            consumer.stop()
            await task
            await follower.stop()
            await pub.close()
    return {"command": "python benchmarks/ipc_direct.py " + " ".join(sys.argv[1:]), "gib": nbytes / (1 << 30),
            "layers": a.layers, "reps": a.reps, "cores": os.cpu_count(), "rows": rows}


def summary(out: dict[str, Any]) -> str:
    keys = ["end_to_end_s", "publish_s", "stage_call_s", "swap_call_s", "release_s"]
    med = {m: {k: statistics.median(r[k] for r in out["rows"] if r["mode"] == m) for k in keys} for m in ("lease", "direct")}
    lines = [f"# Direct swaps of a leased IPC version against the copy into the shadow ({out['gib']:.2f} GiB, CPU)", "",
             f"`{out['command']}`: {out['layers']} float32 layers, one in-process worker with shadow weights, "
             f"{out['cores']} cores; medians of {out['reps']} updates each, in blocks taking turns (ms).", "",
             "| mode | end to end | publish call | staging | swap call | release after | swap | served = published |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in ("lease", "direct"):
        r = [x for x in out["rows"] if x["mode"] == m]
        lines.append(f"| {m} | " + " | ".join(f"{med[m][k] * 1000:.1f}" for k in keys)
                     + f" | {sorted({x['swap'] for x in r})} | {all(x['weights_match'] for x in r)} |")
    lines += ["", "direct / lease: " + ", ".join(f"{k} {med['direct'][k] / med['lease'][k]:.2f}x" for k in keys
                                               if med["lease"][k] > 0), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=6, help="measured updates per mode")
    ap.add_argument("--out", help="write <out>.json and <out>.md")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = asyncio.run(run(a))
    write_results(a.out, out, summary(out))


if __name__ == "__main__":
    main()
