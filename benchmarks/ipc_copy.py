"""The IPC transport's two halves without an engine: the trainer exposing a version, another
process copying and verifying it through the worker's own opener.

    python benchmarks/ipc_copy.py [--gib 1] [--tensors 8] [--device cpu|cuda] [--reps 3] [--out PATH]

Cases, one JSON line each (and ``<out>.json`` + ``<out>.md`` with ``--out``): tensors already
in shared memory (``share_memory_()``, or any CUDA tensor: zero-copy, checksummed at publish
and verified by the copier); on CPU, tensors the exposure copies once (checksummed too); and
the publisher's own snapshot (``WeightPublisher(ipc_snapshot=True)``) of a later version,
copied into the last version's snapshot, with no checksum either side (the copier checks that
the version is still exposed after its copy); and the trainer's tensors leased
(``WeightPublisher(ipc_lease=True)``: zero-copy, no checksum either side, the trainer changing
them only after the release). Times in seconds, medians of ``--reps``
versions; ``copy_s`` is the copy in the other process (onto the same device), ``verify_s``
what it checks after it; ``per_version_s`` the trainer's and the copier's parts together. On
CPU this is the path CI runs; the CUDA cases need a GPU.
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


def child() -> None:
    from rollq.weightsync.checksum import state_checksum
    from rollq.weightsync.ipc_wire import decode_handles
    from rollq.weightsync.worker._ipc import IpcStaging, _token_alive

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
    ok = _token_alive(h) if h.owned else state_checksum(outs) == h.checksum  # as IpcStaging._verify checks
    t3 = time.perf_counter()
    print(json.dumps({"open_s": round(t1 - t0, 4), "copy_s": round(t2 - t1, 4), "verify_s": round(t3 - t2, 4), "ok": ok,
                      "copy_GB_per_s": round(h.nbytes / 1e9 / (t2 - t1), 2)}))


def copier(device: str, x: object) -> dict:
    """The other process's open, copy and verify of exposure ``x``."""
    from rollq.weightsync.ipc_wire import encode_handles

    p = subprocess.run([sys.executable, __file__, "child", device], input=encode_handles(x.handles).hex() + "\n",
                       capture_output=True, text=True, check=True)
    out: dict = json.loads(p.stdout)
    return out


def main() -> None:
    from rollq.weightsync.trainer.ipc_export import Exposure

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3, help="versions per case (medians)")
    ap.add_argument("--out", help="write <out>.json and <out>.md")
    a = ap.parse_args()
    n = int(a.gib * (1 << 30) / 4 / a.tensors)
    items = [(f"w{i}", torch.randn(n, dtype=torch.float32, device=a.device)) for i in range(a.tensors)]
    cases = ["zero-copy", "snapshot", "lease"] if a.device != "cpu" else ["zero-copy", "copied once", "snapshot", "lease"]
    rows = []
    for case in cases:
        shared = case != "copied once"
        its = [(name, t.clone().share_memory_() if shared and a.device == "cpu" else t) for name, t in items]
        reps, last = [], None
        for v in range(1, a.reps + 2):  # the first version is a warm-up (a snapshot's allocates it)
            if case == "snapshot":
                x = Exposure(v, its, snapshot=True, into=last.snapshot if last is not None else None)
            else:
                x = Exposure(v, its, lease=case == "lease")
            if v > 1:
                assert case != "snapshot" or x.reused
                got = {"expose_s": x.expose_s, "checksum_s": x.checksum_s, "copied_GB": x.copied_bytes / 1e9, **copier(a.device, x)}
                got["per_version_s"] = got["expose_s"] + got["checksum_s"] + got["open_s"] + got["copy_s"] + got["verify_s"]
                reps.append(got)
            x.release()
            last = x
        out = {"device": a.device, "GB": round(x.nbytes / 1e9, 3), "case": case, "versions": len(reps),
               "ok": all(r["ok"] for r in reps)}
        for k in ("expose_s", "checksum_s", "copied_GB", "open_s", "copy_s", "verify_s", "per_version_s"):
            out[k] = round(statistics.median(r[k] for r in reps), 4)
        print(json.dumps(out))
        rows.append(out)
    if a.out:
        base = rows[0]["per_version_s"]
        md = [f"`python benchmarks/ipc_copy.py --gib {a.gib} --tensors {a.tensors} --device {a.device} --reps {a.reps}` "
              f"({rows[0]['GB']} GB, medians of {a.reps} versions, seconds)", "",
              "| case | expose | checksum | copied GB | open | copy | verify | per version | vs zero-copy | ok |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['case']} | {r['expose_s']} | {r['checksum_s']} | {r['copied_GB']} | {r['open_s']} | {r['copy_s']} | "
               f"{r['verify_s']} | {r['per_version_s']} | {r['per_version_s'] / base:.2f}x | {r['ok']} |" for r in rows]
        Path(a.out + ".json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
        Path(a.out + ".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    child() if sys.argv[1:2] == ["child"] else main()
