"""The command line and the examples, run as a user would (subprocesses, real redis-server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def rollq(*args: str, url: str | None = None, stdin: str | None = None, timeout: float = 120,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if url:
        env["ROLLQ_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "rollq.cli", "--log-level", "WARNING", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def test_submit_wait_status_and_dlq_through_the_cli(redis_url, queue):
    # A replica that drains the queue and exits.
    r = rollq("submit", "--queue", queue, str(ROOT / "examples" / "jobs.jsonl"), url=redis_url)
    assert r.returncode == 0, r.stderr
    ids = [json.loads(line)["id"] for line in r.stdout.splitlines()]
    assert len(ids) == 3 and "chat-1" in ids
    st = json.loads(rollq("status", "--queue", queue, "--json", url=redis_url).stdout)
    assert st["depth"] == 3 and st["in_flight"] == 0 and st["submitted"] == 3
    c = rollq("consume", "--queue", queue, "--engine", "echo", "--burst", "--id", "cli-replica", url=redis_url)
    assert c.returncode == 0, c.stderr
    st = json.loads(rollq("status", "--queue", queue, "--json", url=redis_url).stdout)
    assert st["depth"] == 0 and st["completed"] == 3

    # --wait: one JSON line per result; '-' reads stdin; a malformed line fails before anything is sent.
    bad = rollq("submit", "--queue", queue, "-", stdin='{"prompt": "x", "sampling": {"n": 0}}\n', url=redis_url)
    assert bad.returncode == 2 and "n must be" in bad.stderr
    consumer = subprocess.Popen(
        [sys.executable, "-m", "rollq.cli", "consume", "--queue", queue, "--engine", "echo", "--id", "w1"],
        env=dict(os.environ, ROLLQ_REDIS_URL=redis_url), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        w = rollq("submit", "--queue", queue, "--wait", "-", url=redis_url,
                  stdin='{"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3, "logprobs": 0}, "meta": 1}\n')
        assert w.returncode == 0, w.stderr
        (line,) = w.stdout.splitlines()
        res = json.loads(line)
        assert res["outputs"][0]["token_ids"] == [5, 6, 5] and res["policy_version"] == [0, 0] and res["meta"] == 1
        assert len(res["outputs"][0]["logprobs"]) == 3
        assert rollq("check", "--queue", queue, "--id", "w1", url=redis_url).returncode == 0
        assert rollq("check", "--queue", queue, "--id", "nobody", url=redis_url).returncode == 1
    finally:
        consumer.terminate()
        assert consumer.wait(30) == 0  # SIGTERM: drains and exits cleanly

    # Dead letters: list, requeue, purge.
    import redis as redis_sync

    from rollq.keys import QueueKeys

    redis_sync.Redis.from_url(redis_url).xadd(QueueKeys(queue).jobs, {"d": b"\x92\x01garbage"})
    rollq("consume", "--queue", queue, "--engine", "echo", "--burst", url=redis_url)
    items = json.loads(rollq("dlq", "list", "--queue", queue, "--json", url=redis_url).stdout)
    assert len(items) == 1 and items[0]["error_type"] == "JobRejected" and not items[0]["requeueable"]
    rq = json.loads(rollq("dlq", "requeue", "--queue", queue, "--json", url=redis_url).stdout)
    assert rq == {"requeued": 0, "skipped": 1}
    assert json.loads(rollq("dlq", "purge", "--queue", queue, "--json", url=redis_url).stdout) == {"purged": 1}


def test_demo_with_the_echo_engine_prints_its_summary(tmp_path):
    r = rollq("demo", "--engine", "echo", "--steps", "5", "--json", "--plot", str(tmp_path / "d.png"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    for key in ("reward_by_step", "reward_first", "reward_last", "random_policy_reward", "versions", "lag_histogram",
                "weight_update_s", "pause_s", "rollout_tokens_per_s", "logprob_abs_diff_mean", "logprob_abs_diff_max",
                "wall_s", "plot"):
        assert key in s
    assert s["steps"] == 5 and s["jobs"] == 80 and s["failed_jobs"] == 0
    assert (tmp_path / "d.png").stat().st_size > 0 and (tmp_path / "d.json").exists()


def test_demo_with_its_replicas_in_a_process_of_their_own(tmp_path):
    """``rollq demo --replica-process``: the replicas run in a child process (ReplicasProcess);
    every step's jobs come back and the summary says where the replicas ran."""
    r = rollq("demo", "--engine", "echo", "--replica-process", "--steps", "3", "--json", "--plot", str(tmp_path / "d.png"),
              timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["replica_process"] is True and s["steps"] == 3 and s["jobs"] == 48 and s["failed_jobs"] == 0
    assert "RuntimeWarning" not in r.stderr, r.stderr[-3000:]


def test_demo_mps_where_mps_cannot_run_is_a_clear_error_before_anything_starts(tmp_path):
    """``rollq demo --mps`` on a machine without NVIDIA's MPS control program: exit 2 and why."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "nvidia-cuda-mps-control").exists())
    r = rollq("demo", "--engine", "echo", "--mps", "--steps", "2", "--plot", str(tmp_path / "d.png"),
              env={"PATH": path}, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "rollq demo --mps: nvidia-cuda-mps-control not found" in r.stderr
    assert not (tmp_path / "d.png").exists()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.slow
def test_demo_mps_on_one_gpu_runs_the_trainer_and_the_replica_as_clients_of_its_daemon(tmp_path):
    """``rollq demo --mps --transport ipc`` on one GPU: the trainer and the replica's engine
    attach to the demo's MPS server, CUDA IPC works between them, every version goes live."""
    pytest.importorskip("vllm")
    r = rollq("demo", "--mps", "--transport", "ipc", "--replicas", "1", "--steps", "4", "--json", "--plot",
              str(tmp_path / "d.png"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["mps_servers"], s
    assert s["versions"] == 4 and s["failed_jobs"] == 0
    assert s["logprob_tokens_compared"] > 0 and s["logprob_abs_diff_mean"] <= 1e-3


def test_quickstart_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == 16


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_trains_through_vllm_replicas(tmp_path):
    """The main job, as a user runs it (shortened): 2 vLLM replicas, a trainer, a version per
    step; the replicas' logprobs agree with the trainer's at each version."""
    pytest.importorskip("vllm")
    r = rollq("demo", "--steps", "12", "--json", "--plot", str(tmp_path / "d.png"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["versions"] == 12 and s["failed_jobs"] == 0 and len(s["reward_by_step"]) == 12
    assert all(0.0 <= x <= 1.0 for x in s["reward_by_step"]) and s["random_policy_reward"] == 0.25
    assert s["logprob_tokens_compared"] > 0 and s["logprob_abs_diff_mean"] <= 1e-3
    assert set(s["lag_histogram"]) <= {"0", "1"}
    assert 0 <= s["pause_s"] <= s["weight_update_s_max"]
    assert (tmp_path / "d.png").stat().st_size > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_over_ipc_leases_the_trainers_tensors_and_every_version_goes_live(tmp_path):
    """``rollq demo --transport ipc``: the demo's publisher leases the trainer's tensors (the
    loop releases each version before the trainer's next optimizer step); every version
    reaches the replica and its logprobs agree with the trainer's."""
    import argparse

    from rollq.demo import _publisher

    assert _publisher("redis://127.0.0.1:1", "/nowhere", argparse.Namespace(transport="ipc", replicas=1)).ipc_lease
    assert not _publisher("redis://127.0.0.1:1", "/nowhere", argparse.Namespace(transport="memmap", replicas=1)).ipc_lease
    pytest.importorskip("vllm")
    r = rollq("demo", "--transport", "ipc", "--replicas", "1", "--steps", "4", "--json", "--plot", str(tmp_path / "d.png"),
              timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["versions"] == 4 and s["failed_jobs"] == 0
    assert s["logprob_tokens_compared"] > 0 and s["logprob_abs_diff_mean"] <= 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_length_pins_one_replica_and_reports_the_final_policy_by_length(tmp_path):
    """``--task length --replicas 1`` on a CPU machine of 2 or more cores: the replica's vLLM on
    the last core, the trainer on the rest (``cores``; with a GPU nothing is pinned); the summary
    ends with the final policy on all 28 prompts, by target length."""
    pytest.importorskip("vllm")
    import torch

    from rollq.rl.cores import plan_cores

    r = rollq("demo", "--task", "length", "--replicas", "1", "--steps", "3", "--json", "--plot",
              str(tmp_path / "d.png"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.splitlines()[-1])
    plan = None if torch.cuda.is_available() else plan_cores(1)
    assert s["cores"] == ({"trainer": list(plan.trainer), "replicas": list(plan.replicas)} if plan else None)
    assert s["versions"] == 3 and s["failed_jobs"] == 0 and s["scale_rewards"] == "group"
    assert s["explore"] == {"max_temperature": 2.0}  # the recipe's exploration (processed logprobs)
    assert list(s["final_by_length"]) == [str(n) for n in range(2, 9)]
    assert 0.0 <= s["reward_final"] <= 1.0


def test_demo_recipe_fills_the_entropy_bonus_unless_the_command_line_sets_it():
    from rollq.cli.main import build_parser
    from rollq.demo import RECIPES, exploration, resolve

    p = build_parser()
    a = resolve(p.parse_args(["demo", "--task", "positional"]))
    assert a.entropy_coef == RECIPES["positional"]["entropy_coef"] == 0.0
    a = resolve(p.parse_args(["demo", "--task", "positional", "--entropy-coef", "0.003"]))
    assert a.entropy_coef == 0.003 and a.lr == RECIPES["positional"]["lr"] and a.steps == RECIPES["positional"]["steps"]
    a = resolve(p.parse_args(["demo", "--task", "length"]))
    assert a.scale_rewards == RECIPES["length"].get("scale_rewards", "group") and a.pin is True
    a = resolve(p.parse_args(["demo", "--task", "length", "--scale-rewards", "none", "--no-pin"]))
    assert a.scale_rewards == "none" and a.pin is False
    assert exploration(a) == RECIPES["length"]["explore"]
    assert exploration(resolve(p.parse_args(["demo", "--task", "length", "--explore-max", "1"]))) is None
    assert exploration(resolve(p.parse_args(["demo", "--task", "positional"]))) is None


def test_demo_lr_schedule_decays_to_its_floor_and_the_command_line_sets_it():
    from rollq.cli.main import build_parser
    from rollq.demo import RECIPES, lr_at, resolve

    rates = [lr_at(5e-3, 100, s, 1e-3) for s in range(1301)]
    assert rates[0] == rates[100] == 5e-3 and rates[400] == 1.25e-3
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises
    assert min(rates) == rates[500] == rates[-1] == 1e-3
    assert lr_at(2e-3, 100, 400) == lr_at(2e-3, 100, 400, 0.0) == 5e-4  # no floor: the plain decay
    p = build_parser()
    a = resolve(p.parse_args(["demo", "--task", "length"]))
    assert a.lr_min == RECIPES["length"].get("lr_min", 0.0)
    a = resolve(p.parse_args(["demo", "--task", "length", "--lr-min", "1e-3", "--steps", "1300"]))
    assert a.lr_min == 1e-3 and a.steps == 1300 and a.lr == RECIPES["length"]["lr"]
