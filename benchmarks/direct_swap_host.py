"""The host time of a direct swap (``WeightSyncSettings.ipc_direct``) inside the swap call, where
generation stands still: the plan's copies made while staging, against made in the swap.

    python benchmarks/direct_swap_host.py [--tensors 339] [--reps 200] [--out benchmarks/results/direct_swap_host]

One in-process worker (``rollq.testing.fake_workers``) with shadow weights over a model of
``--tensors`` small float32 tensors (a 7B Qwen2 checkpoint has 339), so that the copies' bytes
cost next to nothing and what is timed is the Python and dispatch around them. Each version is
exposed leased (``Exposure(lease=True)``) in this process, staged for a direct swap, and swapped
in with ``apply_staged``; versions take turns between the swap using the copies the staging made
(``IpcStaging.plan_copy``) and the swap making them itself (the same function, called in the
swap). Medians of ``--reps`` swaps each, microseconds; ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_results  # noqa: E402  (beside this script)


class Model(torch.nn.Module):
    """``n`` parameters with vLLM's ``load_weights`` entry point (a plain copy per tensor)."""

    def __init__(self, n: int):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(8, 8), requires_grad=False) for _ in range(n)])

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return set(params)


def stage_leased(ipc: Any, items: list[tuple[str, torch.Tensor]], version: int, last: Any) -> Any:
    """The trainer's step (``items`` filled with ``version``), ``version`` exposed leased in
    place of ``last`` (released), and staged for a direct swap by the worker's ``ipc``
    staging; the new exposure."""
    from rollq.weightsync.ipc_wire import encode_handles
    from rollq.weightsync.trainer.ipc_export import Exposure

    for _, t in items:
        t.fill_(float(version))
    x = Exposure(version, items, lease=True)
    if last is not None:
        last.release()
    ipc.stage(encode_handles(x.handles), version, direct=True)
    ipc.wait()
    assert ipc.status.state.value == "staged", ipc.status
    return x


def main() -> None:
    from rollq.testing.fake_workers import FakeWorker
    from rollq.weightsync.worker._swap import apply_staged

    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=339)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ["ROLLQ_SHADOW_WEIGHTS"] = "1"  # "auto" uses them on GPUs only
    torch.set_num_threads(1)
    worker = FakeWorker(Model(a.tensors))
    st = worker.rollq_state
    ipc = st.ipc
    items = [(n, p.detach().clone().share_memory_()) for n, p in Model(a.tensors).named_parameters()]
    times: dict[str, list[float]] = {"made while staging": [], "made in the swap": []}
    x = None
    for v in range(1, 2 * a.reps + 3):
        x = stage_leased(ipc, items, v, x)
        case = "made while staging" if v % 2 else "made in the swap"
        if case == "made in the swap":
            ipc.plan_copy = None
        t0 = time.perf_counter()
        report = apply_staged(st, v)
        dt = time.perf_counter() - t0
        if v > 2:  # the first traces the plan (through the shadow), the second is the first direct
            assert report.swap is not None and report.swap.value == "direct", report
            times[case].append(dt * 1e6)
        assert bool((next(iter(worker.model_runner.model.parameters())) == float(v)).all())
    x.release()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"command": "python benchmarks/direct_swap_host.py " + " ".join(sys.argv[1:]), "tensors": a.tensors, "reps": a.reps,
           "median_us": med, "ratio": med["made while staging"] / med["made in the swap"]}
    md = (f"# Host time of a direct swap's call ({a.tensors} tensors)\n\n`{out['command']}`, medians of {len(times['made in the swap'])} "
          "swaps each, taking turns, µs:\n\n| the plan's copies | apply_staged |\n| --- | --- |\n"
          + "".join(f"| {k} | {v:.0f} |\n" for k, v in med.items()) + f"\nratio: {out['ratio']:.2f}x\n")
    write_results(a.out, out, md)


if __name__ == "__main__":
    main()
