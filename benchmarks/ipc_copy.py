"""The IPC transport's two halves without an engine: the trainer exposing a version, another
process copying and verifying it through the worker's own opener.

    python benchmarks/ipc_copy.py [--gib 1] [--tensors 8] [--device cpu|cuda]

Prints one JSON line per case: tensors already in shared memory (``share_memory_()``, or any
CUDA tensor: zero-copy) and, on CPU, tensors the exposure copies once. Times in seconds;
``copy_s`` is the copy in the other process (onto the same device), ``verify_s`` the checksum
it checks there. On CPU this is the path CI runs; the CUDA case needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def child() -> None:
    from rollq.weightsync.checksum import state_checksum
    from rollq.weightsync.ipc_wire import decode_handles
    from rollq.weightsync.worker._ipc import IpcStaging

    h = decode_handles(bytes.fromhex(sys.stdin.readline().strip()))
    dev = torch.device(sys.argv[2])

    class Host:  # the worker state IpcStaging asks for (no shadow weights)
        lock = None
        device = dev

    staging = IpcStaging(Host())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    srcs = staging._open(h)
    t1 = time.perf_counter()
    outs = [(n, staging._copy_one(i, s)) for i, (n, s) in enumerate(srcs)]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    ok = state_checksum(outs) == h.checksum
    t3 = time.perf_counter()
    print(json.dumps({"open_s": round(t1 - t0, 4), "copy_s": round(t2 - t1, 4), "verify_s": round(t3 - t2, 4), "ok": ok,
                      "copy_GB_per_s": round(h.nbytes / 1e9 / (t2 - t1), 2)}))


def main() -> None:
    from rollq.weightsync.trainer.ipc_export import Exposure
    from rollq.weightsync.ipc_wire import encode_handles

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    n = int(a.gib * (1 << 30) / 4 / a.tensors)
    items = [(f"w{i}", torch.randn(n, dtype=torch.float32, device=a.device)) for i in range(a.tensors)]
    cases = [True] if a.device != "cpu" else [True, False]
    for shared in cases:
        its = [(name, t.clone().share_memory_() if shared and a.device == "cpu" else t) for name, t in items]
        x = Exposure(1, its)
        p = subprocess.run([sys.executable, __file__, "child", a.device], input=encode_handles(x.handles).hex() + "\n",
                           capture_output=True, text=True, check=True)
        out = {"device": a.device, "GB": round(x.nbytes / 1e9, 3), "zero_copy": shared, "expose_s": round(x.expose_s, 4),
               "checksum_s": round(x.checksum_s, 4), "copied_GB": round(x.copied_bytes / 1e9, 3)}
        out.update(json.loads(p.stdout))
        print(json.dumps(out))
        x.release()


if __name__ == "__main__":
    child() if sys.argv[1:2] == ["child"] else main()
