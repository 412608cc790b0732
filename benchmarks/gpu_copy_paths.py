"""The device-side building blocks of a weight update, each timed on its own (2 GPUs, torch only):

    python benchmarks/gpu_copy_paths.py [--reps 3] [--out benchmarks/results/gpu_copy_paths]

A Qwen2.5-7B-shaped bf16 state (339 tensors, 15.2 GB) on GPU 0 (trainer) and GPU 1 (replica):

- ``swap``: copying 15.2 GB of shadow parameters into the live ones on GPU 1, as
  ``torch._foreach_copy_`` and as one ``copy_`` per tensor;
- ``checksum``: rollq's device checksum (``rollq.weightsync.checksum.state_checksum``) of the
  whole state on GPU 1;
- ``h2d``: page-locked host memory -> the 339 tensors on GPU 1, all queued at once and in
  256 MiB chunks with 3 in flight (rollq's default memmap read throttle);
- ``broadcast``: GPU 0 -> GPU 1 over NCCL: one flat buffer (the ceiling), one broadcast per
  tensor into per-tensor destinations (rollq's ``direct`` mode), and the same per-tensor
  broadcasts coalesced into NCCL groups of about 1 and 4 GiB; each also with a synthetic
  load on GPU 1 on another stream, standing in for a busy engine: bf16 matmuls (compute)
  or device copies (memory-bound, as decoding is). ``--broadcast-only`` skips the rest
  (to compare NCCL settings given through the environment).

Each figure is the median of ``--reps`` runs, timed with a device synchronize around it.
Results go to ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _timed(fn, dev: torch.device, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class SyntheticLoad:
    """Work back to back on its own stream of ``dev`` (a stand-in for a busy engine):
    ``compute``: bf16 matmuls; ``memory``: 2 GiB device copies (HBM-bound, as decoding is)."""

    def __init__(self, dev: torch.device, kind: str = "compute"):
        self.dev, self.kind, self.stop = dev, kind, threading.Event()
        if kind == "compute":
            self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        else:
            self.a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
            self.b = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        torch.cuda.set_device(self.dev)
        s = torch.cuda.Stream(self.dev)
        with torch.cuda.stream(s):
            while not self.stop.is_set():
                for _ in range(4):
                    if self.kind == "compute":
                        self.a @ self.a
                    else:
                        self.b.copy_(self.a)
                s.synchronize()

    def __enter__(self) -> "SyntheticLoad":
        self.t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.t.join()


def _rank(rank: int, port: int, reps: int, q: "mp.Queue", broadcast_only: bool = False) -> None:
    from benchmarks.gpu_nccl_transport import qwen7b_shapes
    from rollq.weightsync.nccl import GroupInfo, make_group

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    shapes = qwen7b_shapes()
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=dev).normal_() for _, s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    res: dict[str, float] = {}
    if rank == 1 and not broadcast_only:
        from rollq.weightsync.checksum import state_checksum

        shadow = [torch.empty_like(t).normal_() for t in tensors]

        def per_tensor() -> None:
            for d, s in zip(tensors, shadow):
                d.copy_(s)

        res["swap foreach_copy_"] = _timed(lambda: torch._foreach_copy_(tensors, shadow), dev, reps)
        res["swap copy_ per tensor"] = _timed(per_tensor, dev, reps)
        items = [(n, t) for (n, _), t in zip(shapes, tensors)]
        res["checksum (state_checksum)"] = _timed(lambda: state_checksum(items), dev, reps)
        del shadow
        torch.cuda.empty_cache()
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        srcs, off = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            srcs.append(host[off : off + n])
            off += n
        stream = torch.cuda.Stream(dev)

        def h2d(chunk: int, inflight: int) -> None:
            from collections import deque

            pending: deque = deque()
            with torch.cuda.stream(stream):
                for t, s in zip(tensors, srcs):
                    flat = t.view(-1).view(torch.uint8)
                    if inflight <= 0:
                        flat.copy_(s, non_blocking=True)
                        continue
                    for o in range(0, s.numel(), chunk):
                        flat[o : o + chunk].copy_(s[o : o + chunk], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record()
                        pending.append(ev)
                        if len(pending) > inflight:
                            pending.popleft().synchronize()
            stream.synchronize()

        res["h2d all queued"] = _timed(lambda: h2d(0, 0), dev, reps)
        res["h2d 3 x 256 MiB in flight"] = _timed(lambda: h2d(256 << 20, 3), dev, reps)
        del host, srcs
    info = GroupInfo(id="copy", host="127.0.0.1", port=port, world_size=2, backend="nccl", timeout=600)
    g = make_group(info, rank, dev)
    g.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev), 600)

    def barrier() -> None:
        g.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev), 600)
        torch.cuda.synchronize(dev)

    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    views = [t.view(-1).view(torch.uint8) for t in tensors]
    def grouped(limit: int) -> list[list[torch.Tensor]]:
        out, cur, size = [], [], 0
        for v in views:
            cur.append(v)
            size += v.numel()
            if size >= limit:
                out.append(cur)
                cur, size = [], 0
        return out + ([cur] if cur else [])

    def raw() -> None:
        g.broadcast(flat, 600, wait=False).wait()

    def per_tensor_bc() -> None:
        for v in views:
            g.broadcast(v, 600, wait=False)

    def coalesced(groups: list[list[torch.Tensor]]) -> None:
        for grp in groups:
            g.pg._start_coalescing()
            for v in grp:
                g.broadcast(v, 600, wait=False)
            g.pg._end_coalescing().wait()

    g1, g4 = grouped(1 << 30), grouped(4 << 30)
    bucket = 1 << 30
    bufs = [torch.empty(bucket, dtype=torch.uint8, device=dev) for _ in range(2)]
    spans, pos = [], 0  # (tensor index, byte offset in the flat layout)
    for i, v in enumerate(views):
        spans.append((i, pos))
        pos += v.numel()

    def packed() -> None:
        # rank 0 packs its tensors into two alternating 1 GiB buffers; rank 1 receives each
        # bucket and scatters it into its tensors (stream-ordered: no host waits)
        works = [None, None]
        for bi, start in enumerate(range(0, pos, bucket)):
            end = min(pos, start + bucket)
            slot = bi % 2
            if works[slot] is not None:
                works[slot].wait()
            buf = bufs[slot][: end - start]
            parts = []
            for i, off in spans:
                n = views[i].numel()
                lo, hi = max(off, start), min(off + n, end)
                if hi > lo:
                    parts.append((views[i][lo - off : hi - off], buf[lo - start : hi - start]))
            if rank == 0:
                for src, dst in parts:
                    dst.copy_(src, non_blocking=True)
            works[slot] = g.broadcast(buf, 600, wait=False)
            if rank == 1:
                works[slot].wait()
                for dst, src in parts:
                    dst.copy_(src, non_blocking=True)
        for w in works:
            if w is not None:
                w.wait()

    patterns = {"broadcast raw (one flat buffer)": raw, "broadcast per tensor": per_tensor_bc, "broadcast coalesced ~1 GiB groups": lambda: coalesced(g1),
                "broadcast coalesced ~4 GiB groups": lambda: coalesced(g4),
                "broadcast coalesced, one group": lambda: coalesced([views]),
                "broadcast packed 1 GiB buckets + scatter": packed}
    for loaded in (None, "compute", "memory"):
        for name, fn in patterns.items():
            key = name + (f" + {loaded} load on GPU 1" if loaded else "")
            ts = []
            for _ in range(reps):
                barrier()
                ctx = SyntheticLoad(dev, loaded) if (loaded and rank == 1) else None
                if ctx:
                    ctx.__enter__()
                barrier()
                t0 = time.perf_counter()
                try:
                    fn()
                    torch.cuda.synchronize(dev)
                    ts.append(time.perf_counter() - t0)
                except Exception as e:  # coalescing not supported for broadcast, say
                    res[key + " (error)"] = f"{type(e).__name__}: {e}"
                    break
                finally:
                    if ctx:
                        ctx.__exit__()
            if ts:
                res[key] = statistics.median(ts)
    q.put((rank, res, nbytes, len(tensors)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--broadcast-only", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/gpu_copy_paths")
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    from rollq.server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, a.reps, q, a.broadcast_only)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    while len(got) < 2:
        r, res, nbytes, n = q.get(timeout=900)
        got[r] = res
    for p in procs:
        p.join(60)
    gb = nbytes / 1e9
    # broadcasts: the receiver's (rank 1) view; it includes the slower side
    rows = dict(got[1])
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "nccl_env": env, "tensors": n, "bytes": nbytes,
           "reps": a.reps, "seconds": rows, "trainer_seconds": got[0], "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    lines = [f"Weight-update building blocks, {n} tensors / {gb:.1f} GB bf16 (Qwen2.5-7B shapes), {out['gpu']}, "
             f"median of {a.reps}; NCCL environment {env}", "", "| operation | time | GB/s |", "| --- | --- | --- |"]
    for k, v in rows.items():
        lines.append(f"| {k} | {v * 1000:.1f} ms | {gb / v:.0f} |" if isinstance(v, float) else f"| {k} | {v} | |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
