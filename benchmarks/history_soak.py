"""Exactly once under faults, at scale: the history checker of tests/system/test_history.py
over 100,000 jobs (consumer SIGKILLs, Redis SIGKILLs with AOF ``appendfsync always``, a
producer whose connections a proxy cuts every 2-40 ms).

    python benchmarks/history_soak.py [--jobs 100000] [--rounds 20] [--consumers 2]
                                      [--redis-kills 2] [--out benchmarks/results/history_soak]

Writes ``<out>.json`` and ``<out>.md``: lost, duplicated and stuck jobs (all must be 0),
deliveries and redeliveries, faults injected, wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.system.soak import SoakConfig, run_soak  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--redis-kills", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=4.0, help="seconds between consumer SIGKILLs")
    ap.add_argument("--cut-min", type=float, default=0.002)
    ap.add_argument("--cut-max", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/history_soak")
    a = ap.parse_args()
    cfg = SoakConfig(jobs=a.jobs, rounds=a.rounds, consumers=a.consumers, redis_kills=a.redis_kills,
                     consumer_kill_every=a.kill_every, cut_every=(a.cut_min, a.cut_max), seed=a.seed,
                     delay_ms=0.0, drain_timeout=180.0)
    rep = asyncio.run(run_soak(cfg))
    out = {"command": "python " + " ".join(sys.argv), **rep.__dict__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    c = rep.check
    md = [
        f"# History soak ({a.jobs} jobs)", "", f"`{out['command']}`", "",
        "| submitted | in doubt | results | lost | duplicates | stuck | deliveries | redelivered | consumer SIGKILLs | Redis SIGKILLs | proxy cuts | submit errors | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {c['submitted']} | {rep.in_doubt} | {c['results']} | {c['lost']} | {c['duplicates']} | {c['stuck']} | {c['deliveries']} | "
        f"{c['redelivered']} | {rep.consumer_kills} | {rep.redis_kills} | {rep.proxy_cuts} | {rep.submit_errors} | {rep.wall_s} |",
    ]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print(json.dumps(c))
    return 0 if c["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
