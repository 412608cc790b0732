"""An RL run's replicas in a child process (ReplicasProcess): the same calls as Replicas,
the child's failures told to the trainer, and no child left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rollq.rl import BucketTask, LoopConfig, run_loop
from rollq.rl.replica_host import ReplicaHostError, ReplicasProcess


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


async def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not _alive(pid)


async def test_the_loop_runs_against_replicas_in_a_child_process(redis_url, queue):
    """run_loop through echo replicas hosted by a child: every step's batch arrives, the
    snapshot counts the tokens the child's engines generated; the child is gone after stop."""
    config = LoopConfig(steps=3, groups_per_step=4, group_size=2, seed=0, result_timeout=30)
    async with ReplicasProcess(redis_url, "unused-start-queue", weights_root=None, count=2, engine="echo") as rs:
        pid = rs.pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        await rs.attach(queue)
        report = await run_loop(redis_url, queue, None, BucketTask(vocab_size=1024, length=2), _Tok(), None, config)
        snap = await rs.snapshot()
    s = report.summary()
    assert s["steps"] == 3 and s["failed_jobs"] == 0 and len(report.jobs) == 3 * 4
    assert {replica for replica, _, _ in report.jobs} <= {"replica-0", "replica-1"}
    assert snap.versions == [0, 0] and snap.generated_tokens == 3 * 4 * 2 * 2 and snap.model == "echo"
    assert await _gone(pid)


async def test_a_failed_call_is_raised_here_and_the_host_serves_on(redis_url, queue):
    async with ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="echo") as rs:
        with pytest.raises(TimeoutError, match="version 5"):
            await rs.wait_version(5, timeout=0.2)
        with pytest.raises(ReplicaHostError, match="Attach failed"):
            await rs.attach("bad queue name with spaces\n" * 50)
        await rs.attach(queue)
        assert (await rs.snapshot()).versions == [0]


async def test_a_call_its_caller_gives_up_on_leaves_the_next_calls_their_own_replies(redis_url, queue):
    """A ``wait_version`` cancelled by its caller (``asyncio.wait_for``) is cancelled in the
    child too, and its reply never answers a later call: the next snapshot is a snapshot, and
    a later ``wait_version`` for a version no replica serves times out rather than returning
    on a stale reply. A snapshot in between comes back while the abandoned wait would still
    run (60 s), and so do calls made at once from two tasks."""
    async with ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="echo") as rs:
        for _ in range(3):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(rs.wait_version(5, timeout=60), 0.1)
            assert (await asyncio.wait_for(rs.snapshot(), 20)).versions == [0]
        with pytest.raises(TimeoutError, match="version 7"):
            await rs.wait_version(7, timeout=0.3)
        waits = [asyncio.ensure_future(rs.wait_version(9, timeout=0.5)) for _ in range(2)]
        snaps = await asyncio.gather(rs.snapshot(), rs.snapshot())
        assert [s.versions for s in snaps] == [[0], [0]]
        for w in waits:
            with pytest.raises(TimeoutError, match="version 9"):
                await w
        await rs.attach(queue)
        assert (await rs.snapshot()).versions == [0]


async def test_a_call_that_does_not_decode_is_answered_to_its_caller(redis_url, queue):
    """The host reads the number of a call it cannot decode and answers that caller why; the
    calls after it are answered as before."""
    import msgspec

    async with ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="echo") as rs:
        with pytest.raises(ReplicaHostError, match="ProtocolError"):
            await rs._exchange(10_000, msgspec.msgpack.encode({"type": "reboot", "seq": 10_000}), 30, "reboot")
        assert (await rs.snapshot()).versions == [0]


async def test_replicas_that_cannot_start_are_an_error_naming_why(redis_url, queue, tmp_path):
    rs = ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="vllm", model=str(tmp_path / "no-model"))
    with pytest.raises(ReplicaHostError, match="start failed in the replica host"):
        await rs.start()
    assert rs.pid is not None and not _alive(rs.pid)  # the failed start ended its child
    await rs.stop()


async def test_the_child_stops_when_the_trainer_side_goes_away(redis_url, queue):
    """The trainer's process dying closes the socket: the child stops its replicas and exits
    by itself (here the socket is closed without the Stop call)."""
    rs = ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="echo")
    await rs.start()
    pid, proc = rs.pid, rs._proc
    assert pid is not None and proc is not None
    rs._writer.close()
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    rs._writer = None
    await rs.stop()


async def test_a_killed_child_is_an_error_not_a_hang(redis_url, queue):
    rs = ReplicasProcess(redis_url, queue, weights_root=None, count=1, engine="echo", call_timeout=30)
    await rs.start()
    try:
        os.kill(rs.pid, signal.SIGKILL)
        with pytest.raises(ReplicaHostError, match="exited|closed"):
            await rs.snapshot()
    finally:
        await rs.stop()
    assert not _alive(rs.pid)


def test_an_unknown_engine_is_refused_before_a_process_starts():
    with pytest.raises(ValueError, match="engine"):
        ReplicasProcess("redis://127.0.0.1:1", "q", weights_root=None, engine="sglang")


@pytest.mark.vllm
@pytest.mark.slow
async def test_grpo_over_ipc_with_the_replica_in_its_own_process(tiny_model_path, redis_url, queue):
    """A real vLLM replica in the host process, the trainer here: async GRPO at lag 1 with its
    versions shared over IPC (CPU shared memory, leased). Every version reaches the replica
    (one update per step, all over ipc) and the replica's behaviour logprobs agree with the
    trainer's at the version they came from, to the bound of the served dtype: the weights crossed exactly."""
    import torch
    from transformers import AutoTokenizer

    from rollq.rl import GrpoConfig, GrpoTrainer
    from rollq.weightsync import WeightPublisher
    from tests.helpers.agreement import CPU_FLOAT32, GPU_FLOAT32, HALF

    torch.set_num_threads(1)
    steps = 4
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    trainer = GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=1e-2), seed=0)
    async with ReplicasProcess(redis_url, queue, weights_root=None, count=1, model=str(tiny_model_path),
                               reconcile_interval=0.5) as rs:
        pub = WeightPublisher(redis_url, queue, root=None, keep=4, ipc_lease=True)
        try:
            rec = await pub.publish_weights(trainer.state_dict(), transport="ipc")
            trainer.rebase(rec.version)
            await rs.wait_version(rec.version)
            config = LoopConfig(steps=steps, groups_per_step=8, group_size=4, mode="async", max_lag=1, seed=0,
                                transport="ipc", result_timeout=120)
            report = await run_loop(redis_url, queue, trainer, BucketTask(vocab_size=len(tokenizer)), tokenizer, pub, config)
            await rs.wait_version(trainer.version)
            snap = await rs.snapshot()
        finally:
            await pub.close()
    s = report.summary()
    assert s["failed_jobs"] == 0 and trainer.version == rec.version + steps
    assert set(s["lag_histogram"]) <= {"0", "1"} and max(s["versions_sampled"]) > rec.version, s
    assert snap.versions == [trainer.version] and snap.generated_tokens > 0
    ups = [u for u in snap.updates if u.version > rec.version]
    assert [u.version for u in ups] == list(range(rec.version + 1, trainer.version + 1))
    assert {u.transport for u in ups} == {"ipc"}
    # the bound of what the child's engine serves (on a GPU "auto" may serve bf16), where it runs
    bound = HALF if snap.served_dtype != "float32" else GPU_FLOAT32 if torch.cuda.is_available() else CPU_FLOAT32
    assert s["logprob_tokens_compared"] > 0 and s["logprob_abs_diff_mean"] <= bound.mean, s
