"""What exposing a version over IPC costs the trainer: every storage shared each version, against
each storage shared once (``Exposure(shares=...)``, what the IPC transport does), in one run.

    python benchmarks/ipc_expose.py [--device cpu|cuda] [--versions 20] [--shrink N] [--out PATH]

This process is the trainer: it holds the 339 tensors of a Qwen2.5-7B-shaped model (bf16; on
CPU in shared memory and each ``--shrink`` times smaller, default 1000 on CPU and 1 on a GPU,
15.2 GB), steps them in place and exposes one leased version after another
(:class:`~rollq.weightsync.trainer.ipc_export.Exposure`), the two ways taking turns. ``expose``
is the exposure's own time (``Exposure.expose_s``: the messages, and on a GPU the wait for the
device); ``counter files`` are the shared-memory files torch made for the reference counters
meanwhile (``/dev/shm/torch_<pid>_*``: one per 10,000 ``_share_cuda_`` calls, each call also an
IPC event, kept while the storage lives). No worker maps anything here (``ipc_open.py`` is the
worker's side) and no engine competes for the GPU. Results: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _counter_files() -> int:
    return len(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


def main() -> None:
    from benchmarks.gpu_nccl_transport import qwen7b_flat
    from rollq.weightsync.trainer.ipc_export import Exposure

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--versions", type=int, default=20, help="versions exposed each way")
    ap.add_argument("--shrink", type=int, default=0, help="each tensor this many times smaller (0: 1000 on CPU, 1 on a GPU)")
    ap.add_argument("--out", default="benchmarks/results/ipc_expose")
    a = ap.parse_args()
    shrink = a.shrink or (1000 if a.device == "cpu" else 1)
    items = qwen7b_flat(a.device, shrink)
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    rows: list[dict] = []
    shares = None
    files = {"every": 0, "once": 0}
    for version in range(1, 2 * a.versions + 3):
        way = "every" if version % 2 else "once"
        with torch.no_grad():
            for _, t in items:  # the optimizer's step: in place, the same storages
                t.view(-1)[:1].fill_(float(version))
        before = _counter_files()
        t0 = time.perf_counter()
        x = Exposure(version, items, lease=True, shares=shares if way == "once" else None)
        call_s = time.perf_counter() - t0
        x.release()
        if way == "once":
            shares = x.shares
        if version > 2:  # the first of each way is a warm-up (the first "once" shares everything)
            files[way] += _counter_files() - before
            rows.append({"version": version, "way": way, "expose_s": x.expose_s, "call_s": call_s,
                         "shared_again": len(items) - x.shares_reused if way == "once" else len(x.handles.storages)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def med(way: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["way"] == way)

    out = {"device": a.device, "gpu": torch.cuda.get_device_name(0) if a.device != "cpu" else None, "tensors": len(items),
           "GB": nbytes / 1e9, "shrink": shrink, "torch": torch.__version__, "versions_each": a.versions, "rows": rows,
           "expose_ms": {w: med(w, "expose_s") * 1e3 for w in ("every", "once")},
           "call_ms": {w: med(w, "call_s") * 1e3 for w in ("every", "once")},
           "counter_files": files, "shared_again": {w: med(w, "shared_again") for w in ("every", "once")}}
    out["ratio_once_to_every"] = out["expose_ms"]["once"] / out["expose_ms"]["every"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=1))
    md = [f"A version exposed by the trainer, {len(items)} tensors ({nbytes / 1e9:.3f} GB bf16, {a.device}"
          f"{', ' + out['gpu'] if out['gpu'] else ''}), leased, median of {a.versions} versions each way (taking turns), idle",
          "", "| | storages shared each version | expose | the whole call | counter files made |",
          "| --- | ---: | ---: | ---: | ---: |",
          f"| every storage shared each version | {out['shared_again']['every']:.0f} | {out['expose_ms']['every']:.2f} ms | "
          f"{out['call_ms']['every']:.2f} ms | {files['every']} |",
          f"| each storage shared once (`shares`) | {out['shared_again']['once']:.0f} | {out['expose_ms']['once']:.2f} ms | "
          f"{out['call_ms']['once']:.2f} ms | {files['once']} |",
          f"| ratio | | {out['ratio_once_to_every']:.3f} | {out['call_ms']['once'] / out['call_ms']['every']:.3f} | |", ""]
    Path(a.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
