"""What a receive loop of GIL-releasing calls costs next to a busy Python thread (CPU only):

    python benchmarks/gil_roundtrips.py [--calls 339] [--out benchmarks/results/gil_roundtrips]

A weight receiver runs one collective call per tensor in a thread of the vLLM worker process,
whose engine thread keeps the interpreter busy. Every such call releases the GIL and has to win
it back. Here a busy thread spins in Python while the measured thread makes ``--calls`` calls,
either GIL-releasing (``time.sleep(0)``, as a c10d collective call releases it) or not (a small
torch op), at several ``sys.setswitchinterval`` values; also with no busy thread, as reference.
Median of 5; results go to ``<out>.json`` and ``<out>.md``.
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

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=339)
    ap.add_argument("--out", default="benchmarks/results/gil_roundtrips")
    a = ap.parse_args()
    bufs = [torch.empty(16) for _ in range(a.calls)]

    def releasing() -> None:
        for _ in bufs:
            time.sleep(0)

    def holding() -> None:
        for b in bufs:
            b.fill_(1.0)

    def timed(fn) -> float:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    rows = []
    saved = sys.getswitchinterval()
    for busy in (False, True):
        stop = threading.Event()
        if busy:
            def spin() -> None:
                x = 0
                while not stop.is_set():
                    for i in range(1000):
                        x += i * i
            threading.Thread(target=spin, daemon=True).start()
        for si in (0.005, 0.0002, 0.00005, 0.00001, 0.000001):
            sys.setswitchinterval(si)
            rows.append({"busy_thread": busy, "switch_interval_ms": si * 1e3,
                         "gil_releasing_s": timed(releasing), "gil_holding_s": timed(holding)})
        stop.set()
        sys.setswitchinterval(saved)
        time.sleep(0.05)
    out = {"calls": a.calls, "cpus": os.cpu_count(), "python": sys.version.split()[0], "rows": rows,
           "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    lines = [f"{a.calls} calls, {out['cpus']} CPUs, Python {out['python']}, median of 5", "",
             "| busy Python thread | switch interval | GIL-releasing calls | GIL-holding calls |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {'yes' if r['busy_thread'] else 'no'} | {r['switch_interval_ms']:g} ms | "
                     f"{r['gil_releasing_s'] * 1e3:.1f} ms | {r['gil_holding_s'] * 1e3:.1f} ms |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
