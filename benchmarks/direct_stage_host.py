"""The host time of staging a leased version for a direct swap (``WeightSyncSettings.ipc_direct``),
which runs in a worker thread beside the engine and shares its GIL: the manifest and the plan's
copies built once over the kept mappings, against built for every version.

    python benchmarks/direct_stage_host.py [--tensors 339] [--reps 200] [--out benchmarks/results/direct_stage_host]

One in-process worker (``rollq.testing.fake_workers``) without shadow weights (a direct replica
builds none: the first version traces the load plan on the live weights) over a model of
``--tensors`` small float32 tensors (a 7B Qwen2 checkpoint has 339), so that what is timed is the
Python around the bytes. Each version is exposed leased in this process, staged for a direct
swap (``IpcStaging.stage``, timed by the worker: ``StageStatus.stage_s``) and swapped in;
versions take turns between the worker reusing what it built from the kept views
(``MappedStorages.derived``) and building it again. Medians of ``--reps`` stagings each,
microseconds; ``<out>.json`` and ``<out>.md``. Beside a busy vLLM engine each Python call also
waits for the GIL, so the saving there is larger than here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from _report import write_results
    from direct_swap_host import Model, stage_leased

    from rollq.testing.fake_workers import FakeWorker
    from rollq.weightsync.worker._ipc_maps import MappedStorages
    from rollq.weightsync.worker._swap import apply_staged

    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=339)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    worker = FakeWorker(Model(a.tensors))
    st = worker.rollq_state
    ipc = st.ipc
    kept = ipc.maps.derived

    def every_time(views: Any, name: str, ident: Any, make: Callable[[], Any]) -> Any:
        return make()

    items = [(n, p.detach().clone().share_memory_()) for n, p in Model(a.tensors).named_parameters()]
    times: dict[str, list[float]] = {"built once, reused": [], "built every version": []}
    x = None
    for v in range(1, 2 * a.reps + 4):
        case = "built once, reused" if v % 2 else "built every version"
        ipc.maps.derived = kept if v % 2 else every_time  # type: ignore[method-assign]
        x = stage_leased(ipc, items, v, x)
        if v > 3:  # the first traces the plan, the second builds the copies, the third is the first reuse
            times[case].append(ipc.status.stage_s * 1e6)
        report = apply_staged(st, v)
        assert report.swap is not None and report.swap.value == "direct", report
        assert bool((next(iter(worker.model_runner.model.parameters())) == float(v)).all())
    assert isinstance(ipc.maps, MappedStorages) and st.shadow is None and st.live_plan is not None
    x.release()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"command": "python benchmarks/direct_stage_host.py " + " ".join(sys.argv[1:]), "tensors": a.tensors, "reps": a.reps,
           "median_us": med, "ratio": med["built once, reused"] / med["built every version"]}
    md = (f"# Host time of staging a direct version ({a.tensors} tensors)\n\n`{out['command']}`, medians of "
          f"{len(times['built once, reused'])} stagings each, taking turns, µs (StageStatus.stage_s):\n\n"
          "| the manifest and the plan's copies | staging |\n| --- | --- |\n"
          + "".join(f"| {k} | {v:.0f} |\n" for k, v in med.items()) + f"\nratio: {out['ratio']:.2f}x\n")
    write_results(a.out, out, md)


if __name__ == "__main__":
    main()
