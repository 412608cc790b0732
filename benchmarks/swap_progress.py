"""What a swap's report of the requests' progress costs, every request of the last 30 s against
the requests in flight (``VllmEngine.progress_since``).

    python benchmarks/swap_progress.py [--rate 400] [--running 256] [--duration 1.0] [--reps 30]
                                       [--out benchmarks/results/swap_progress_cpu]

At every swap each vLLM worker reports how many tokens each request had (rollq's per-token
versions); it includes the requests vLLM let go of lately, whose outputs may still be on their
way to the replica. Before: all of the last 30 s (``--rate`` requests a second end, 400 being
an H100's rate in the RL loop's medium runs: ~12,000 entries); after: those let go of since the
oldest request in flight was submitted, less 5 s (``--duration``: how long a request runs).
Timed per swap, the two taking turns: the worker's report (inside the swap, between two engine
steps), the reply's msgpack round trip (as ``collective_rpc`` carries it, approximately), and
the replica's mapping of it to its jobs (``VllmEngine.swap_progress``, on the replica's event
loop). The worker's tracker and the adapter are rollq's own, on stand-ins for vLLM's runner.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollq.consumer._vllm_swaps import PROGRESS_SLACK_S, SwapLedger  # noqa: E402
from rollq.weightsync.wire import Progress, from_wire, to_wire  # noqa: E402
from rollq.weightsync.worker._progress import RequestTracker  # noqa: E402


def setup(rate: float, running: int, duration: float) -> tuple[RequestTracker, SimpleNamespace, SwapLedger]:
    """A tracker that saw ``rate`` requests a second end over 30 s, a worker holding ``running``
    requests (started over the last ``duration`` s), and the adapter's ledger waiting for those."""
    now, mono = time.time(), time.monotonic()
    tracker = RequestTracker()
    n_done = int(rate * 30)
    tracker.removed = collections.OrderedDict(
        (f"{uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}", (4, mono - 30 + 30 * i / n_done, now - 30 + 30 * i / n_done))
        for i in range(n_done))
    ours = [uuid.uuid4().hex for _ in range(running)]
    reqs = {f"{rid}-{uuid.uuid4().hex[:8]}": SimpleNamespace(output_token_ids=[1, 2, 3]) for rid in ours}
    worker = SimpleNamespace(model_runner=SimpleNamespace(requests=reqs))
    ledger = SwapLedger()
    ledger.submitted = {rid: now - duration + duration * i / running for i, rid in enumerate(ours)}
    ledger.recent = collections.OrderedDict((rid.rsplit("-", 1)[0], None) for rid in list(tracker.removed)[-4096:])
    return tracker, worker, ledger


def one_swap(tracker: RequestTracker, worker: SimpleNamespace, ledger: SwapLedger, since: float) -> dict:
    tracker.since = since
    t0 = time.perf_counter()
    progress = tracker.report(worker)
    t1 = time.perf_counter()
    wire = msgspec.msgpack.encode(to_wire(progress))
    back = from_wire(msgspec.msgpack.decode(wire), Progress)
    t2 = time.perf_counter()
    mapped = ledger.progress(back, complete=True)
    t3 = time.perf_counter()
    assert set(ledger.submitted) <= set(mapped.tokens)  # every request in flight found
    return {"entries": len(progress.tokens), "bytes": len(wire), "worker_ms": 1e3 * (t1 - t0),
            "wire_ms": 1e3 * (t2 - t1), "adapter_ms": 1e3 * (t3 - t2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=400.0, help="requests ended per second over the last 30 s")
    ap.add_argument("--running", type=int, default=256, help="requests in flight at the swap")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds a request runs")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/swap_progress_cpu")
    a = ap.parse_args()
    tracker, worker, ledger = setup(a.rate, a.running, a.duration)
    ways = {"before (last 30 s)": lambda: 0.0, "after (since the oldest in flight)": ledger.since}
    got: dict[str, list[dict]] = {k: [] for k in ways}
    for _ in range(a.reps):  # taking turns
        for name, since in ways.items():
            got[name].append(one_swap(tracker, worker, ledger, since()))
    rows = [{"way": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}} for name, rs in got.items()]
    res = {"command": "python benchmarks/swap_progress.py " + " ".join(sys.argv[1:]), "rate": a.rate, "running": a.running,
           "duration_s": a.duration, "slack_s": PROGRESS_SLACK_S, "reps": a.reps, "rows": rows}
    lines = [f"# A swap's progress report: `{res['command']}`", "",
             f"{a.rate:g} requests/s ended over 30 s, {a.running} in flight started over {a.duration:g} s; medians of {a.reps}.", "",
             "| report | entries | msgpack bytes | worker report (ms) | msgpack round trip (ms) | replica mapping (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['entries']:.0f} | {r['bytes']:.0f} | {r['worker_ms']:.2f} | {r['wire_ms']:.2f} | {r['adapter_ms']:.2f} |")
    b, f = rows
    lines += ["", f"after / before: worker {f['worker_ms'] / b['worker_ms']:.3f}x, round trip {f['wire_ms'] / b['wire_ms']:.3f}x, "
              f"mapping {f['adapter_ms'] / b['adapter_ms']:.3f}x"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
