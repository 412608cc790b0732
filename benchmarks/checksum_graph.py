"""What does replaying rollq's device checksum as a captured CUDA graph save, idle and beside a
busy engine?

    python benchmarks/checksum_graph.py [--reps 7] [--gib N] [--out benchmarks/results/checksum_graph]

Weight sync checksums every version twice on the update's critical path (the trainer when it
publishes, the replica when it verifies the bytes it copied), and on the replica the
checksum runs in a thread that shares the GIL with vLLM's engine loop. Variants, on the same
tensors, taking turns per rep:

- ``per-tensor (before)``: the checksum as rollq computed it until 2026-12-04 (about 8 kernels
  and as many Python calls per tensor: a zeroed lane row, the reduction, the tail, the
  weighting, a sum per tensor), eager;
- ``eager``: rollq's checksum (``state_checksum``): one reduction per
  tensor into a stacked ``[tensors, 4096]`` lane matrix, weighted and summed once;
- ``graphed``: the same captured once as a CUDA graph and replayed (``graph=True``, what
  the IPC transport uses).

Each variant runs ``idle`` and ``busy``: beside a thread that keeps a second CUDA stream busy
with small matmuls from a Python loop (what a serving engine's loop looks like to the
checksum: competing for the GIL and the GPU). Figures are wall time per version including the
host sync, medians over the reps, and each variant's ratio to ``per-tensor (before)`` in the
same condition. Without ``--gib`` the tensors are the Qwen2.5-7B-shaped bf16 set of
``gpu_nccl_transport.py`` (339 tensors, 15.2 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LANES = 4096
LANE_BYTES = 8 * LANES


def per_tensor_before(items: list[tuple[str, torch.Tensor]]) -> int:
    """rollq's checksum before the stacked form (the same value, more kernels per tensor)."""
    from rollq.weightsync import checksum as ck

    dev = items[0][1].device
    w = ck._lane_weights(dev)
    sums = []
    for _, t in items:
        raw = t.reshape(-1).view(torch.uint8)
        n = raw.numel()
        full = (n // LANE_BYTES) * LANE_BYTES
        lanes = torch.zeros(LANES, dtype=torch.int64, device=dev)
        if full:
            lanes += raw[:full].view(torch.int64).view(-1, LANES).sum(0)
        if n > full:
            tail = torch.zeros(LANE_BYTES, dtype=torch.uint8, device=dev)
            tail[: n - full] = raw[full:]
            lanes += tail.view(torch.int64)
        sums.append((lanes * w).sum())
    s = torch.stack(sums)
    consts = ck._consts(items)
    h = s * 1099511628211 + consts[:, 0]
    return int(((h ^ consts[:, 1]) * 0x100000001B3).sum().item()) & ck._MASK


def rollq_checksum(graphs: bool):
    from rollq.weightsync.checksum import state_checksum

    def run(items: list[tuple[str, torch.Tensor]]) -> int:
        return int(state_checksum(items, graph=graphs), 16)

    return run


class Busy:
    """A thread keeping another CUDA stream busy from a Python loop (no host syncs)."""

    def __init__(self, dev: torch.device):
        self.dev, self.stop, self.steps = dev, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = torch.randn(1024, 1024, device=self.dev, dtype=torch.bfloat16)
        with torch.cuda.stream(torch.cuda.Stream(self.dev)):
            while not self.stop.is_set():
                for _ in range(8):
                    x = torch.tanh(x @ x)
                torch.cuda.current_stream(self.dev).synchronize()  # like an engine step's end
                self.steps += 1

    def __enter__(self) -> Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gib", type=float, help="8 bf16 tensors of this many GiB in all, instead of the 7B set")
    ap.add_argument("--out", default="benchmarks/results/checksum_graph")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("checksum_graph: needs a CUDA GPU (graphs are the question)")
    dev = torch.device("cuda")
    if a.gib:
        n = int(a.gib * (1 << 30) / 2 / 8)
        items = [(f"t{i}", torch.randn(n, device=dev, dtype=torch.bfloat16)) for i in range(8)]
    else:
        from benchmarks.gpu_nccl_transport import qwen7b_shapes

        items = [(name, torch.empty(s, dtype=torch.bfloat16, device=dev).normal_()) for name, s in qwen7b_shapes()]
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    variants = {"per-tensor (before)": per_tensor_before, "eager": rollq_checksum(False), "graphed": rollq_checksum(True)}
    values = {name: f(items) for name, f in variants.items()}  # warm-up, and the capture
    assert len(set(values.values())) == 1, f"the variants disagree: {values}"
    out: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "tensors": len(items),
                 "GB": round(nbytes / 1e9, 2), "reps": a.reps, "conditions": {}}
    for cond in ("idle", "busy"):
        times: dict[str, list[float]] = {k: [] for k in variants}
        ctx = Busy(dev) if cond == "busy" else None
        if ctx:
            ctx.__enter__()
        try:
            for _ in range(a.reps):
                for name, f in variants.items():
                    torch.cuda.current_stream(dev).synchronize()
                    t0 = time.perf_counter()
                    f(items)
                    times[name].append(time.perf_counter() - t0)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        rows = {}
        for name, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            rows[name] = {"median_ms": round(med * 1000, 2), "min_ms": round(min(ts) * 1000, 2),
                          "max_ms": round(max(ts) * 1000, 2), "GB_per_s": round(nbytes / 1e9 / med, 1)}
        base = rows["per-tensor (before)"]["median_ms"]
        for r in rows.values():
            r["ratio_to_before"] = round(r["median_ms"] / base, 3)
        out["conditions"][cond] = rows
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"Checksum of {len(items)} tensors, {out['GB']} GB, on {out['device']} (torch {out['torch']}; median of {a.reps})", "",
             "| condition | variant | ms (min-max) | GB/s | ratio to before |", "| --- | --- | ---: | ---: | ---: |"]
    for cond, rows in out["conditions"].items():
        lines += [f"| {cond} | {k} | {v['median_ms']} ({v['min_ms']}-{v['max_ms']}) | {v['GB_per_s']} | {v['ratio_to_before']} |"
                  for k, v in rows.items()]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
