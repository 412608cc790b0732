"""benchmarks/fleet_sim.py, run tiny: 20 replicas in one worker process, its own redis-server.

The simulator starts and removes its own server (``rollq.server.RedisServer`` on a free
loopback port) and its worker process; the test reads the JSON report it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

SIM = ROOT / "benchmarks" / "fleet_sim.py"
REPLICAS = 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fleet") / "fleet_sim"
    cmd = [
        sys.executable, str(SIM), "--replicas", str(REPLICAS), "--procs", "1", "--targets", "single",
        "--idle", "3", "--load-seconds", "2", "--rates", "300,max", "--settle", "1", "--baseline", "1",
        "--calibrate-jobs", "200", "--warmup", "1", "--worker-max-seconds", "200", "--out", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, f"fleet_sim failed ({proc.returncode}): {proc.stdout[-3000:]} {proc.stderr[-3000:]}"
    data = json.loads(out.with_suffix(".json").read_text())
    md = out.with_suffix(".md").read_text()
    return data, md


def test_report_structure(report):
    data, md = report
    assert set(data) >= {"command", "env", "args", "targets"}
    (t,) = data["targets"]
    assert "error" not in t, t.get("error")
    assert t["target"] == "single" and t["replicas"] == REPLICAS
    for key in ("baseline", "submit_calibration", "start", "warmup", "idle", "load", "exactly_once", "workers", "summary"):
        assert key in t, key
    assert [x["offered_per_s"] for x in t["load"]] == [300.0, None]
    s = t["summary"]
    assert s["idle_nominal"]["us_per_replica_per_s_at_this_n"] > 0
    assert s["cpu_per_job_us"]["submit_alone"] > 0
    assert "max_replicas" in s["fleet_at_budget"]["current_reclaim_best"]
    assert "## single: 20 replicas in 1 processes" in md and "### Under load" in md


def test_every_job_exactly_one_result(report):
    data, _ = report
    (t,) = data["targets"]
    once = t["exactly_once"]
    assert once["submitted"] > 200  # the calibration's jobs and every load phase's
    assert once["results"] == once["submitted"]
    assert once["missing"] == 0 and once["duplicate_results_seen"] == 0 and once["unknown_results"] == 0
    assert once["failed"] == 0
    assert all(d["drained"] for d in t["load"])
    (w,) = t["workers"]
    assert w.get("done") and w["replicas"] == REPLICAS and w["stuck_at_stop"] == 0
    assert w["completed"] == once["submitted"]  # no job ran twice either (no lease expired)
    assert w["exit_codes"] == [0]


def test_idle_commands_counted(report):
    data, _ = report
    (t,) = data["targets"]
    idle = t["idle"]
    assert idle["group_consumers"] == REPLICAS
    fam = idle["families"]
    assert fam["heartbeat"]["calls"] > 0 and fam["pull"]["calls"] > 0 and fam["reclaim"]["calls"] > 0
    assert idle["commands"]["set"]["calls"] > 0  # the lease key
    assert idle["commands"]["xreadgroup"]["calls"] > 0
    assert "scripts (SUBMIT, FINISH)" not in fam  # no job: no script ran
    # every replica beat and scanned about once a second (20 replicas keep up on one loop)
    assert idle["cycles_per_replica_per_s"]["heartbeat"] > 0.5
