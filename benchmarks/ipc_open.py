"""Opening a version's IPC handles in a worker: every handle each version, against the mappings
kept from the last version (``WeightSyncSettings.ipc_keep_mappings``), in one run.

    python benchmarks/ipc_open.py [--device cpu|cuda] [--cycles 5] [--shrink N] [--out PATH]

This process is the trainer: it holds the 339 tensors of a Qwen2.5-7B-shaped model (bf16; on
CPU in shared memory and each ``--shrink`` times smaller, default 1000 on CPU and 1 on a GPU,
15.2 GB), steps them in place and exposes one version after another
(:class:`~rollq.weightsync.trainer.ipc_export.Exposure`). A child process is the worker: it
opens each version through the worker's own opener (``IpcStaging._open``) and unmaps what it
does not keep. Each cycle is three versions: one with every handle opened and unmapped after
(``keep 0``), one that maps them again for the next (a warm-up, not counted), and one through the
kept mappings (``keep 1``). The trainer shares each storage once (``Exposure(shares=...)``),
as the IPC transport does; opening a storage takes a reference to it
(:func:`rollq.weightsync.ipc_counters.take`), a kept one takes none. ``open_s`` is the
opening, ``close_s`` the unmapping after the copy (where the worker unmaps). Idle: no engine competes for the GIL or the GPU here, so the figures
are lower bounds of what a worker beside a busy engine sees (``gpu_vllm.py --phases ipc``).
Results: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(device_name: str) -> None:
    from rollq.weightsync.ipc_wire import decode_handles
    from rollq.weightsync.worker._ipc import IpcStaging

    class Host:  # the worker state IpcStaging asks for (no shadow weights)
        lock = None
        device = torch.device(device_name)

    staging = IpcStaging(Host())  # type: ignore[arg-type]
    for line in sys.stdin:
        raw, keep = line.split()
        h = decode_handles(bytes.fromhex(raw))
        staging.keep_maps = keep != "0"
        t0 = time.perf_counter()
        srcs = staging._open(h)
        t1 = time.perf_counter()
        del srcs
        if not staging.keep_maps:
            staging.maps.clear()
        t2 = time.perf_counter()
        print(json.dumps({"open_s": t1 - t0, "close_s": t2 - t1, "opened": staging.maps.opened,
                          "reused": staging.maps.reused}), flush=True)


def main() -> None:
    from benchmarks.gpu_nccl_transport import qwen7b_flat
    from rollq.weightsync.ipc_wire import encode_handles
    from rollq.weightsync.trainer.ipc_export import Exposure

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--shrink", type=int, default=0, help="each tensor this many times smaller (0: 1000 on CPU, 1 on a GPU)")
    ap.add_argument("--out", default="benchmarks/results/ipc_open")
    a = ap.parse_args()
    shrink = a.shrink or (1000 if a.device == "cpu" else 1)
    items = qwen7b_flat(a.device, shrink)
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    proc = subprocess.Popen([sys.executable, __file__, "child", a.device], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdin is not None and proc.stdout is not None
    rows: list[dict] = []
    version = 0
    shares = None
    try:
        for cycle in range(a.cycles):
            for keep, counted in (("0", True), ("1", False), ("1", True)):
                version += 1
                with torch.no_grad():
                    for _, t in items:  # the optimizer's step: in place, the same storages
                        t.view(-1)[:1].fill_(float(version))
                x = Exposure(version, items, shares=shares)
                shares = x.shares
                proc.stdin.write(encode_handles(x.handles).hex() + f" {keep}\n")
                proc.stdin.flush()
                got = json.loads(proc.stdout.readline())
                x.release()
                row = {"cycle": cycle, "version": version, "keep": keep != "0", "counted": counted, **got}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        proc.stdin.close()
        proc.wait(60)

    def med(keep: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["counted"] and r["keep"] == keep)

    out = {"device": a.device, "gpu": torch.cuda.get_device_name(0) if a.device != "cpu" else None, "tensors": len(items),
           "GB": nbytes / 1e9, "shrink": shrink, "torch": torch.__version__, "rows": rows,
           "open_ms": {"every_handle": med(False, "open_s") * 1e3, "kept": med(True, "open_s") * 1e3},
           "close_ms": {"every_handle": med(False, "close_s") * 1e3, "kept": med(True, "close_s") * 1e3}}
    out["ratio_open_plus_close"] = ((med(True, "open_s") + med(True, "close_s"))
                                    / (med(False, "open_s") + med(False, "close_s")))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=1))
    md = [f"IPC handles opened by a worker, {len(items)} tensors ({nbytes / 1e9:.3f} GB bf16, {a.device}"
          f"{', ' + out['gpu'] if out['gpu'] else ''}), median of {a.cycles} versions each, idle",
          "", "| | every handle each version | kept from the last version | ratio |", "| --- | ---: | ---: | ---: |",
          f"| open | {out['open_ms']['every_handle']:.2f} ms | {out['open_ms']['kept']:.2f} ms | "
          f"{out['open_ms']['kept'] / out['open_ms']['every_handle']:.3f} |",
          f"| unmap after the copy | {out['close_ms']['every_handle']:.2f} ms | {out['close_ms']['kept']:.2f} ms | - |",
          f"| both | {out['open_ms']['every_handle'] + out['close_ms']['every_handle']:.2f} ms | "
          f"{out['open_ms']['kept'] + out['close_ms']['kept']:.2f} ms | {out['ratio_open_plus_close']:.3f} |", ""]
    Path(a.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    child(sys.argv[2]) if sys.argv[1:2] == ["child"] else main()
