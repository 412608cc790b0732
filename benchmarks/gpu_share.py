"""Do a trainer process and a generating process on one GPU run at the same time, without and
with CUDA MPS? Both settings in one run, taking turns.

    python3 benchmarks/gpu_share.py [--reps 3] [--train-iters 15] [--decode-steps 3000] [--out benchmarks/results/gpu_share]

Two processes, each with a CUDA context of its own, as rollq's trainer and a vLLM engine core
on one GPU are:

- ``train``: a trainer's step, fp32 forward and backward through a stack of 4096-wide linear
  layers on 8192 rows (compute bound, every SM busy);
- ``decode``: an engine's decode steps, 16 layers of bf16 matmuls on 256 rows (a batch of
  running requests) and a host synchronisation per step (vLLM samples on the host's word),
  few SMs busy, bound by launches and memory reads.

Each runs alone, then both start together; per process the wall time. Overlap:
``together / (train alone + decode alone)``: 1.0 means the two took turns (no gain from
running them side by side), 0.5 that each ran as if alone. The settings: ``time-sliced``
(no MPS: the GPU switches between the contexts) and ``mps`` (:class:`rollq.rl.mps.MpsDaemon`
started for the run, both processes its clients). Under MPS the run also checks that a
tensor one client exposes through CUDA IPC (what ``--transport ipc`` does) is read whole by
the other. Results: ``<out>.json`` and ``<out>.md``. Needs a GPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_results  # noqa: E402


def _train(iters: int) -> None:
    import torch

    layers = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)]).cuda()
    opt = torch.optim.Adam(layers.parameters(), lr=1e-4)
    x = torch.randn(8192, 4096, device="cuda")
    for _ in range(iters):
        loss = layers(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def _decode(steps: int) -> None:
    import torch

    w1 = [torch.randn(2048, 5632, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(16)]
    w2 = [torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(16)]
    h0 = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        h = h0
        for a, b in zip(w1, w2):
            h = torch.nn.functional.silu(h @ a) @ b
        h[:, 0].sum().item()  # the host waits for each step, as a sampler's result does


WORKLOADS = {"train": _train, "decode": _decode}


def worker(name: str, size: int, start: Any, ready: Any, out: Any) -> None:
    """Warm up (CUDA context, kernels), say so, wait for the start, run, send the wall time."""
    import torch

    torch.cuda.init()
    WORKLOADS[name](max(1, size // 10))
    ready.put(name)
    start.wait()
    t0 = time.perf_counter()
    WORKLOADS[name](size)
    out.put((name, time.perf_counter() - t0))


def run_together(names: list[str], sizes: dict[str, int], on_ready: Any = None) -> dict[str, float]:
    """Start a process per name, release them together once all are warm (calling
    ``on_ready()`` then); their wall times."""
    ctx = mp.get_context("spawn")
    start, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(n, sizes[n], start, ready, out)) for n in names]
    for p in procs:
        p.start()
    for _ in names:
        ready.get(timeout=300)
    if on_ready is not None:
        on_ready()
    start.set()
    times = dict(out.get(timeout=600) for _ in names)
    for p in procs:
        p.join(timeout=60)
    return times


def _expose(q: Any, done: Any) -> None:
    import torch

    t = torch.arange(1 << 24, device="cuda", dtype=torch.float32)
    q.put((t, float(t.sum())))
    done.wait(timeout=120)


def _read(q: Any, out: Any) -> None:
    import torch

    t, expected = q.get(timeout=120)
    copy = t.clone()
    torch.cuda.synchronize()
    out.put(float(copy.sum()) == expected)


def ipc_check() -> bool:
    """One process exposes a CUDA tensor through IPC (torch's reductions), another copies it."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    a = ctx.Process(target=_expose, args=(q, done))
    b = ctx.Process(target=_read, args=(q, out))
    a.start()
    b.start()
    ok = bool(out.get(timeout=180))
    done.set()
    a.join(timeout=60)
    b.join(timeout=60)
    return ok


def measure(sizes: dict[str, int], on_ready: Any = None) -> dict[str, Any]:
    alone = {n: run_together([n], sizes)[n] for n in sizes}
    both = run_together(list(sizes), sizes, on_ready)
    wall = max(both.values())
    return {"alone_s": alone, "together_s": both, "together_wall_s": wall,
            "overlap": wall / sum(alone.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-iters", type=int, default=15)
    ap.add_argument("--decode-steps", type=int, default=3000)
    ap.add_argument("--out", default="benchmarks/results/gpu_share")
    a = ap.parse_args()

    from rollq.rl.mps import MpsDaemon

    sizes = {"train": a.train_iters, "decode": a.decode_steps}
    rows: dict[str, list[dict[str, Any]]] = {"time-sliced": [], "mps": []}
    servers: list[int] = []
    ipc_ok = None
    for rep in range(a.reps):
        for setting in (("time-sliced", "mps") if rep % 2 == 0 else ("mps", "time-sliced")):
            if setting == "mps":
                with MpsDaemon() as daemon:
                    rows[setting].append(measure(sizes, lambda: servers.extend(daemon.servers())))
                    if ipc_ok is None:
                        ipc_ok = ipc_check()
            else:
                rows[setting].append(measure(sizes))
            print(setting, rows[setting][-1], flush=True)

    def med(setting: str, f: Any) -> float:
        return statistics.median(f(r) for r in rows[setting])

    lines = ["| setting | train alone (s) | decode alone (s) | train together | decode together | overlap (1.0: took turns) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in rows:
        lines.append(f"| {s} | {med(s, lambda r: r['alone_s']['train']):.3f} | {med(s, lambda r: r['alone_s']['decode']):.3f} "
                     f"| {med(s, lambda r: r['together_s']['train']):.3f} | {med(s, lambda r: r['together_s']['decode']):.3f} "
                     f"| {med(s, lambda r: r['overlap']):.2f} |")
    import torch

    md = (f"# Two processes on one GPU, without and with MPS\n\n{torch.cuda.get_device_name(0) if torch.cuda.is_available() else '?'}; "
          f"`python3 benchmarks/gpu_share.py --reps {a.reps} --train-iters {a.train_iters} --decode-steps {a.decode_steps}`; "
          f"medians of {a.reps}\n\n" + "\n".join(lines) +
          f"\n\nMPS servers seen while both clients ran: {servers}; a CUDA IPC tensor read whole by another MPS "
          f"client: {ipc_ok}\n")
    write_results(a.out, {"args": vars(a), "rows": rows, "mps_servers": servers, "ipc_under_mps": ipc_ok}, md)


if __name__ == "__main__":
    main()
