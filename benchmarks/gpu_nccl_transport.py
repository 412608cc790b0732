"""NCCL weight transport on GPUs: rollq's bucketed broadcast vs per-tensor patterns.

    python benchmarks/gpu_nccl_transport.py [--receivers N] [--out benchmarks/results/gpu_nccl_transport]

A 7B-shaped bf16 state dict (Qwen2.5-7B shapes: 339 tensors, 15.2 GB) lives on GPU 0 (the
trainer, rank 0); each receiver rank holds model-shaped destination tensors on its own GPU.
Measured in one run, each repeated (median reported):

- ``raw``: one broadcast of a single flat 15.2 GB buffer (the ceiling);
- ``rollq``: rollq's transport (rollq.weightsync.nccl): tensors packed into 1 GiB buckets
  (two buffers, packing overlapped with the previous broadcast), received straight into a
  persistent flat staging buffer whose views are model-shaped tensors (no unpacking copy),
  then copied into the destination tensors (``+ swap``, what a replica does while paused);
- ``per-tensor``: one broadcast per tensor into the destination tensors;
- ``per-tensor + control``: before each tensor, a synchronous control round trip (the trainer
  posts the tensor's name/dtype/shape, every receiver reads it and acknowledges): TorchRL
  0.11's pattern without Ray's own RPC cost.

Needs >= 2 GPUs; NCCL_NVLS_ENABLE=0 stays set (NVLink multicast off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def qwen7b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, inter, layers, kv, vocab = 3584, 18944, 28, 512, 152064
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def qwen7b_flat(device: str, shrink: int) -> list[tuple[str, torch.Tensor]]:
    """The 7B model's tensors as flat bf16 zeros, each ``shrink`` times smaller, on ``device``
    (on CPU in shared memory): a trainer's weights for the IPC benchmarks."""
    items = []
    for name, shape in qwen7b_shapes():
        n = 1
        for d in shape:
            n *= d
        t = torch.zeros(max(1, n // shrink), dtype=torch.bfloat16, device=device)
        items.append((name, t.share_memory_() if device == "cpu" else t))
    return items


def _worker(rank: int, world: int, port: int, reps: int, bucket_mb: int, q: "mp.Queue") -> None:
    from rollq.weightsync.checksum import state_checksum
    from rollq.weightsync.memmap import manifest_of
    from rollq.weightsync.nccl import BroadcastSender, GroupInfo, Layout, Offer, make_group
    from rollq.weightsync.worker._receiver import WorkerReceiver

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    shapes = qwen7b_shapes()
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=dev) for _, s in shapes]
    if rank == 0:
        for t in tensors:
            t.normal_(generator=gen)
    items = [(n, t) for (n, _), t in zip(shapes, tensors)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    info = GroupInfo(id="bench", host="127.0.0.1", port=port, world_size=world, backend="nccl", timeout=600)
    g = make_group(info, rank, dev)
    g.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev), 600)
    store = g.store
    res: dict[str, list[float]] = {"raw": [], "rollq": [], "rollq+swap": [], "per-tensor": [], "per-tensor+control": []}

    def barrier() -> None:
        g.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev), 600)
        torch.cuda.synchronize(dev)

    # raw: one flat buffer
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        g.broadcast(flat, 600)
        torch.cuda.synchronize(dev)
        res["raw"].append(time.perf_counter() - t0)
    del flat
    torch.cuda.empty_cache()

    # rollq transport
    manifest = manifest_of(items)
    if rank == 0:
        sender = BroadcastSender(world - 1, backend="nccl", bucket_bytes=bucket_mb << 20, timeout=600, device=dev)
        sender.group.pg, sender.group.info = g, info
    else:
        rcv = WorkerReceiver(info, rank, dev, g)  # on the group made above
    ck = state_checksum(items) if rank == 0 else ""
    for r in range(reps):
        barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sender._broadcast_all(items, manifest)
        else:
            offer = Offer(version=r + 1, group="bench", checksum="", bucket_bytes=bucket_mb << 20, manifest=manifest, timeout=600)
            layout = Layout.of(manifest, offer.bucket_bytes)
            if rcv.flat is None:
                rcv.flat = torch.empty(layout.total, dtype=torch.uint8, device=dev)
            for s, e in layout.buckets:
                g.broadcast(rcv.flat[s:e], 600)
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        if rank != 0:
            with torch.no_grad():
                for (_, v), t in zip(layout.views(rcv.flat, manifest), tensors):
                    t.copy_(v)
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        res["rollq"].append(t1 - t0)
        res["rollq+swap"].append(t2 - t0)
    if rank != 0:
        got = state_checksum(layout.views(rcv.flat, manifest))
        q.put(("checksum", rank, got))
    else:
        q.put(("checksum", 0, ck))
        sender._bufs = []
    if rank != 0:
        rcv.flat = None
    torch.cuda.empty_cache()

    # per-tensor, no control
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for t in tensors:
            g.broadcast(t.view(-1).view(torch.uint8), 600)
        torch.cuda.synchronize(dev)
        res["per-tensor"].append(time.perf_counter() - t0)

    # per-tensor behind a synchronous control round trip
    for r in range(reps):
        barrier()
        t0 = time.perf_counter()
        for i, (name, t) in enumerate(items):
            key = f"c/{r}/{i}"
            if rank == 0:
                store.set(key, f"{name}|bfloat16|{tuple(t.shape)}")
                store.wait([f"{key}/ack/{k}" for k in range(1, world)], timedelta(seconds=600))
            else:
                store.get(key)
                store.set(f"{key}/ack/{rank}", "1")
            g.broadcast(t.view(-1).view(torch.uint8), 600)
            torch.cuda.synchronize(dev)
        res["per-tensor+control"].append(time.perf_counter() - t0)
    q.put(("res", rank, res, nbytes, len(items)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receivers", type=int, default=None, help="default: every other visible GPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/gpu_nccl_transport")
    a = ap.parse_args()
    n = torch.cuda.device_count()
    receivers = a.receivers if a.receivers is not None else n - 1
    world = receivers + 1
    if n < world or receivers < 1:
        sys.exit(f"needs {world} GPUs, {n} visible")
    from rollq.server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, a.reps, a.bucket_mb, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, checks = {}, {}
    import queue as _queue

    deadline = time.monotonic() + 1800
    while len(results) < world:
        try:
            msg = q.get(timeout=2)
        except _queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                sys.exit(f"ranks failed (rank, exit code): {dead}" if dead else "timed out")
            continue
        if msg[0] == "checksum":
            checks[msg[1]] = msg[2]
        else:
            results[msg[1]] = msg[2:]
    for p in procs:
        p.join(60)
    res0, nbytes, ntensors = results[0]
    worst = {k: max(statistics.median(results[r][0][k]) for r in results) for k in res0}
    gb = nbytes / 1e9
    out = {
        "receivers": receivers, "gpus": n, "tensors": ntensors, "bytes": nbytes, "bucket_mb": a.bucket_mb,
        "reps": a.reps, "seconds": worst, "gb_per_s_per_receiver": {k: gb / v for k, v in worst.items()},
        "checksums_match": len(set(checks.values())) == 1, "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    lines = [
        f"NCCL weight transport, {ntensors} tensors / {gb:.1f} GB bf16 (Qwen2.5-7B shapes), GPU 0 -> {receivers} receiver(s), "
        f"{out['gpu']}, median of {a.reps} (slowest receiver); checksums match: {out['checksums_match']}",
        "",
        "| pattern | seconds | GB/s per receiver | vs raw |",
        "| --- | --- | --- | --- |",
    ]
    for k, v in worst.items():
        lines.append(f"| {k} | {v * 1000:.1f} ms | {gb / v:.1f} | {v / worst['raw']:.2f}x |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
