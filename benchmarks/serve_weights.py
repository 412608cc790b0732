"""A trainer's weight update through ``rollq serve --weight-transfer gloo``, timed on CPU.

    python benchmarks/serve_weights.py [--mb 16 256] [--repeats 3] [--out benchmarks/results/serve_weights]

In one process: a real redis-server, one replica (fake workers: a plain torch module of
``--mb`` MB float32 in 16 square tensors, rollq's whole memmap weight-sync path), ``rollq
serve`` (uvicorn on loopback) with the same tensors as its model folder, and a trainer thread
that speaks TRL's HTTP sequence (httpx) and broadcasts over gloo in vLLM's packed format
(:mod:`rollq.serve.gloo_trainer`). Per update, the median over ``--repeats``:

- ``update_s``: ``POST /update_weights`` while the trainer broadcasts (the receive, gloo on
  loopback, and the checks against the model);
- ``finish_s``: ``POST /finish_weight_update`` (merge, memmap write and checksum, the version
  committed in Redis);
- ``served_s``: from finish's answer until the replica serves the version (rollq's normal
  replica path: read the memmap slot, check, load into the module);
- ``total_s`` and MB/s over the three.

The NCCL path (a GPU trainer, TRL's real ``init_communicator``) is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rollq import Consumer, ConsumerSettings, Producer, RedisServer  # noqa: E402
from rollq.serve import create_app, gloo_trainer  # noqa: E402
from rollq.serve.weights import WeightTransferConfig  # noqa: E402
from rollq.settings import WeightSyncSettings  # noqa: E402
from rollq.testing.fake_workers import FakeWorkerEngine  # noqa: E402
from rollq.weightsync import WeightFollower  # noqa: E402

TENSORS = 16


def model(mb: int) -> torch.nn.Module:
    d = int((mb * (1 << 20) / TENSORS / 4) ** 0.5)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(TENSORS)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(mb: int, repeats: int, url: str, tmp: str) -> dict[str, Any]:
    queue = f"bench-{mb}"
    folder = os.path.join(tmp, f"model-{mb}")
    os.makedirs(folder)
    torch.manual_seed(0)
    base = model(mb)
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, os.path.join(folder, "model.safetensors"))
    root = os.path.join(tmp, f"weights-{mb}")
    engine = FakeWorkerEngine(lambda: model(mb))
    consumer = Consumer(engine, url, queue, settings=ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2))
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.05))
    await follower.start()
    ctask = asyncio.create_task(consumer.run())
    producer = Producer(url, queue)
    app = create_app(producer, model_name="bench", weights=WeightTransferConfig(backend="gloo", root=root, model=folder))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    stask = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    baseurl = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    rows = []
    try:
        async with httpx.AsyncClient(base_url=baseurl, timeout=600) as c:
            info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                    "packed": True}
            post = asyncio.create_task(c.post("/init_weight_transfer_engine", json={"init_info": info}))
            group = await asyncio.to_thread(gloo_trainer.trainer_init, info)
            (await post).raise_for_status()
            trainer = model(mb)
            for i in range(repeats):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.fill_(float(i + 1))
                items = [(n, p.detach()) for n, p in trainer.named_parameters()]
                meta = {"names": [n for n, _ in items], "dtype_names": ["float32"] * len(items),
                        "shapes": [list(t.shape) for _, t in items]}
                (await c.post("/start_weight_update", json={})).raise_for_status()
                t0 = time.perf_counter()
                post = asyncio.create_task(c.post("/update_weights", json={"update_info": meta}))
                sender = threading.Thread(target=gloo_trainer.packed_broadcast_producer,
                                          args=(iter(items), group, 0, lambda it: it[1]))
                sender.start()
                (await post).raise_for_status()
                sender.join()
                t1 = time.perf_counter()
                r = await c.post("/finish_weight_update", json={})
                r.raise_for_status()
                t2 = time.perf_counter()
                version = r.json()["rollq"]["version"]
                while consumer.version < version:
                    await asyncio.sleep(0.005)
                t3 = time.perf_counter()
                w = engine.workers[0].model_runner.model.module[0].weight.detach()
                assert float(w[0, 0]) == float(i + 1), "the replica serves what the trainer sent"
                rows.append({"update_s": t1 - t0, "finish_s": t2 - t1, "served_s": t3 - t2, "total_s": t3 - t0})
    finally:
        server.should_exit = True
        await stask
        consumer.stop()
        await ctask
        await follower.stop()
        await producer.close()
    nbytes = sum(p.nbytes for p in base.parameters())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"mb": round(nbytes / 1e6, 1), "tensors": TENSORS, "repeats": repeats, **med,
            "mb_per_s": round(nbytes / 1e6 / med["total_s"], 1), "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/serve_weights")
    a = ap.parse_args()
    srv = RedisServer()
    srv.start()
    try:
        with tempfile.TemporaryDirectory(prefix="rollq-serve-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
            results = [asyncio.run(run(mb, a.repeats, srv.url, tmp)) for mb in a.mb]
    finally:
        srv.cleanup()
    out = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "results": results,
           "command": " ".join(["python", *sys.argv])}
    Path(a.out + ".json").write_text(json.dumps(out, indent=1))
    lines = ["| MB | update_s (receive) | finish_s (publish) | served_s (replica loads) | total_s | MB/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['mb']} | {r['update_s']:.3f} | {r['finish_s']:.3f} | {r['served_s']:.3f} | {r['total_s']:.3f} | {r['mb_per_s']} |")
    Path(a.out + ".md").write_text(f"`{out['command']}` ({out['cpus']} CPUs, medians of {a.repeats})\n\n" + "\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
