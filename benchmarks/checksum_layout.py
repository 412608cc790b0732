"""How fast is rollq's content checksum on a device, by the layout of its reduction?

    python benchmarks/checksum_layout.py [--device cuda] [--reps 5] [--gib N] [--out benchmarks/results/checksum_layout]

Weight sync checksums every version on both sides (the trainer when it publishes, the replica
when it verifies), so on a GPU the checksum of a 15.2 GB 7B version sits on the update's
critical path twice. Variants, timed on the same tensors, taking turns per rep:

- ``strided`` (rollq's checksum up to 2026-12-04): word ``i`` of a tensor goes to lane
  ``i % 4096``, a reduction over the outer dimension of a ``[N, 4096]`` view;
- ``blocks``: lane ``k`` sums the ``k``-th contiguous block of words, a reduction over the
  inner dimension of a ``[4096, N]`` view (each lane one contiguous row);
- ``flat``: one wrapping int64 sum of the whole tensor (no position weighting; the floor).

Every variant reads each byte once; the figure is wall time per version including the single
host sync at the end, and GB/s. Without ``--gib`` the tensors are the Qwen2.5-7B-shaped bf16
set of ``gpu_nccl_transport.py`` (339 tensors, 15.2 GB); on CPU give ``--gib``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LANES = 4096


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    raw = t.reshape(-1).view(torch.uint8)
    full = (raw.numel() // (4 * LANES)) * 4 * LANES
    tail = raw[full:] if raw.numel() > full else None
    return raw[:full].view(torch.int32), tail


def strided(ts: list[torch.Tensor]) -> int:
    sums = []
    for t in ts:
        w, _ = _words(t)
        sums.append(w.view(-1, LANES).sum(0, dtype=torch.int64).sum())
    return int(torch.stack(sums).sum().item())


def blocks(ts: list[torch.Tensor]) -> int:
    sums = []
    for t in ts:
        w, _ = _words(t)
        sums.append(w.view(LANES, -1).sum(1, dtype=torch.int64).sum())
    return int(torch.stack(sums).sum().item())


def flat(ts: list[torch.Tensor]) -> int:
    sums = []
    for t in ts:
        w, _ = _words(t)
        sums.append(w.sum(dtype=torch.int64))
    return int(torch.stack(sums).sum().item())


def current(ts: list[torch.Tensor]) -> int:
    from rollq.weightsync.checksum import state_checksum

    return int(state_checksum([(f"t{i}", t) for i, t in enumerate(ts)]), 16)


VARIANTS = {"strided": strided, "blocks": blocks, "flat": flat, "rollq": current}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gib", type=float, help="8 float32 tensors of this many GiB in all, instead of the 7B set")
    ap.add_argument("--out", default="benchmarks/results/checksum_layout")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if a.gib:
        n = int(a.gib * (1 << 30) / 4 / 8)
        ts = [torch.randn(n, device=dev) for _ in range(8)]
    else:
        from benchmarks.gpu_nccl_transport import qwen7b_shapes

        ts = [torch.empty(s, dtype=torch.bfloat16, device=dev).normal_() for _, s in qwen7b_shapes()]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    try:
        current(ts[:1])
    except ImportError:  # rollq's dependencies are not installed here (a bare GPU machine)
        del VARIANTS["rollq"]
    for f in VARIANTS.values():  # warm-up (kernels, lane weights)
        f(ts)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(a.reps):
        for name, f in VARIANTS.items():
            sync()
            t0 = time.perf_counter()
            f(ts)
            times[name].append(time.perf_counter() - t0)
    rows = {}
    for name, ts_ in times.items():
        med = sorted(ts_)[len(ts_) // 2]
        rows[name] = {"median_ms": round(med * 1000, 2), "min_ms": round(min(ts_) * 1000, 2), "GB_per_s": round(nbytes / 1e9 / med, 1)}
    base = rows["strided"]["median_ms"]
    for r in rows.values():
        r["ratio_to_strided"] = round(r["median_ms"] / base, 3)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = {"device": dev_name, "tensors": len(ts), "GB": round(nbytes / 1e9, 2), "reps": a.reps, "variants": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    lines = [f"Checksum of {len(ts)} tensors, {out['GB']} GB, on {dev_name} (median of {a.reps})", "",
             "| variant | ms | GB/s | ratio to strided |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['median_ms']} | {v['GB_per_s']} | {v['ratio_to_strided']} |" for k, v in rows.items()]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
