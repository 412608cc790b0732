"""benchmarks/fleet_sim.py, run tiny: 20 replicas in one worker process, its own redis-server;
and 6 replicas on a queue of 3 shards over its own 3-master Redis Cluster (``--shards 3``),
its load offered by two producers (``--producers 2``).

The simulator starts and removes its own server(s) (``rollq.server.RedisServer`` or
``LocalCluster`` on free loopback ports) and its worker process; the tests read the JSON
report it writes.
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


def run_sim(out, *extra: str) -> tuple[dict, str]:
    cmd = [
        sys.executable, str(SIM), "--procs", "1", "--idle", "3", "--load-seconds", "2", "--rates", "300,max",
        "--settle", "1", "--baseline", "1", "--calibrate-jobs", "200", "--warmup", "1",
        "--worker-max-seconds", "200", "--out", str(out), *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, f"fleet_sim failed ({proc.returncode}): {proc.stdout[-3000:]} {proc.stderr[-3000:]}"
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_sim(tmp_path_factory.mktemp("fleet") / "fleet_sim", "--replicas", str(REPLICAS), "--targets", "single")


SHARDED_REPLICAS = 6


@pytest.fixture(scope="module")
def sharded_report(tmp_path_factory):
    return run_sim(tmp_path_factory.mktemp("fleet") / "fleet_sim_sharded", "--replicas", str(SHARDED_REPLICAS),
                   "--targets", "cluster", "--shards", "3", "--producers", "2")


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


def test_per_node_figures_add_up(report):
    data, md = report
    (t,) = data["targets"]
    assert t["shards"] == 1 and t["shard_nodes"] == [0]
    for d in [t["idle"], *t["load"]]:
        (calls_per_s,) = d["node_calls_per_s"]
        assert calls_per_s * d["wall_s"] == pytest.approx(sum(c["calls"] for c in d["commands"].values()))
        assert d["node_commands"][0] == {k: c["calls"] for k, c in d["commands"].items()}
    assert "### Per Redis node: cores · commands/s" in md and "node 0 (shards 0)" in md


def test_sharded_queue_spreads_over_the_masters(sharded_report):
    """K=3 on 3 masters: every shard's node runs jobs (scripts and reads), exactly once."""
    data, md = sharded_report
    (t,) = data["targets"]
    assert "error" not in t, t.get("error")
    assert t["target"] == "cluster" and t["shards"] == 3 and len(t["shard_nodes"]) == 3
    assert len(set(t["shard_nodes"])) == 3  # the queue name "fleet": its 3 shards hash to 3 masters
    once = t["exactly_once"]
    assert once["results"] == once["submitted"] > 200 and once["missing"] == 0 and once["failed"] == 0
    assert once["duplicate_results_seen"] == 0
    # two producers (the parent's and a child process) offered the load, each its own results
    assert t["producers"] == 2 and [c["producer"] for c in t["producer_checks"]] == ["fleet-prod", "fleet-prod-1"]
    assert all(c["missing"] == 0 and c["submitted"] > 0 and c["reader_died"] is None for c in t["producer_checks"])
    assert sum(c["submitted"] for c in t["producer_checks"]) == once["submitted"]
    assert t["left_in_result_streams"] == {}
    busiest = t["load"][-1]  # offered as fast as the producers can
    for node in t["shard_nodes"]:
        cmds = busiest["node_commands"][node]
        assert cmds.get("evalsha", 0) > 0 and cmds.get("xreadgroup", 0) > 0, (node, cmds)
    # every replica takes part in every shard's group (it reads them all)
    assert t["idle"]["group_consumers_per_shard"] == [SHARDED_REPLICAS] * 3
    # a heartbeat renews the lease in each of the 3 shards: one cycle, three SETs
    idle = t["idle"]
    assert idle["commands"]["set"]["calls"] > 0
    assert 0.5 < idle["cycles_per_replica_per_s"]["heartbeat"] < 1.5, idle["cycles_per_replica_per_s"]
    assert "## cluster: 6 replicas in 1 processes, 3 shards" in md
