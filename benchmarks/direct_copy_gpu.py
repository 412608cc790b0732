"""A direct swap's device copies, and the trainer's exposure of a leased version, on one GPU.

    python benchmarks/direct_copy_gpu.py [--reps 5] [--out benchmarks/results/direct_copy_gpu]

A Qwen2.5-7B-shaped bf16 state (339 tensors, 15.2 GB) as the trainer's tensors and as the
live weights, on one GPU (torch only, no engine). A direct swap (``WeightSyncSettings.ipc_direct``)
copies the one into the other's raw bytes by its load plan:

- ``foreach_copy_ over uint8 views``: one ``torch._foreach_copy_`` over the byte views, as
  the swap copied before;
- ``copy_by_plan``: :func:`rollq.weightsync.worker._direct_copy.copy_by_plan` (one memcpy per
  tensor, an event after them);

each alternated, device time between two synchronizes, and the host time of the enqueueing
alone (what the engine's thread spends inside the swap call now that it does not wait).
``expose leased``: the trainer's :class:`~rollq.weightsync.trainer.ipc_export.Exposure` of the
same tensors (``ipc_lease``), the first version and later ones (nothing written in between:
what the call costs beyond the trainer's own step). Medians of ``--reps``; ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _timed(fn: Callable[[], Any], dev: torch.device) -> tuple[float, float]:
    """(seconds until the device finished ``fn``'s work, seconds of host time in ``fn``)."""
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, host


def main() -> None:
    from _report import write_results
    from gpu_nccl_transport import qwen7b_shapes

    from rollq.weightsync.trainer.ipc_export import Exposure
    from rollq.weightsync.worker._direct_copy import copy_by_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("direct_copy_gpu.py needs a GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    shapes = qwen7b_shapes()
    trainer = [(n, torch.empty(s, dtype=torch.bfloat16, device=dev).normal_()) for n, s in shapes]
    live = [torch.empty(s, dtype=torch.bfloat16, device=dev) for _, s in shapes]
    nbytes = sum(t.numel() * t.element_size() for _, t in trainer)
    dsts = [t.view(-1).view(torch.uint8) for t in live]
    srcs = [t.view(-1).view(torch.uint8) for _, t in trainer]
    cases: dict[str, Callable[[], Any]] = {
        "foreach_copy_ over uint8 views": lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True),
        "copy_by_plan": lambda: copy_by_plan(dsts, srcs, dev),
    }
    device_s: dict[str, list[float]] = {k: [] for k in cases}
    host_s: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.reps + 1):  # the first round warms up
        for k, fn in cases.items():
            d, h = _timed(fn, dev)
            device_s[k].append(d)
            host_s[k].append(h)
    assert all(torch.equal(x, y) for x, (_, y) in zip(live, trainer))
    expose: list[float] = []
    for rep in range(a.reps + 1):
        x = Exposure(rep + 1, trainer, lease=True)
        expose.append(x.expose_s)
        x.release()
    med = {k: statistics.median(v[1:]) for k, v in device_s.items()}
    med_host = {k: statistics.median(v[1:]) for k, v in host_s.items()}
    base = med["foreach_copy_ over uint8 views"]
    rows = [f"| {k} | {med[k] * 1e3:.1f} ms | {nbytes * 2 / med[k] / 1e9:.0f} | {med_host[k] * 1e3:.2f} ms | "
            f"{med[k] / base:.2f}x |" for k in cases]
    name = torch.cuda.get_device_name(dev)
    md = "\n".join([
        f"A direct swap's copies by the load plan, {len(shapes)} tensors / {nbytes / 1e9:.1f} GB bf16 (Qwen2.5-7B shapes), "
        f"{name}, median of {a.reps} (taking turns)",
        "",
        "| copy | device time | GB/s (read + write) | host time enqueueing | against foreach |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"The trainer's exposure of the {len(shapes)} tensors, leased (`Exposure(lease=True)`, nothing written "
        f"between versions): first version {expose[0] * 1e3:.2f} ms, later versions "
        f"{statistics.median(expose[1:]) * 1e3:.2f} ms (median of {a.reps}).",
    ])
    write_results(a.out, {"gpu": name, "tensors": len(shapes), "bytes": nbytes, "device_s": device_s, "host_s": host_s,
                          "median_device_s": med, "median_host_s": med_host, "expose_s": expose}, md)


if __name__ == "__main__":
    main()
