"""Broadcast groups that follow the live replicas: a late joiner and a member SIGKILLed mid-broadcast.

Every replica runs in a process of its own (tests/weightsync/replica_proc.py: the real worker
extension, broadcast receiver, listener and follower over gloo); the trainer is this process.
The publishers here have no memmap store: every version must arrive by broadcast.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from rollq import Producer
from rollq.keys import QueueKeys
from rollq.weightsync import WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from rollq.weightsync.replica.worker_calls import WorkerRpc
from tests.helpers import ROOT, until

TIMEOUT = 20.0  # the sender's timeout (group formation, each broadcast, the acks)


def state(size: int, fill: float) -> dict[str, torch.Tensor]:
    m = torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.Linear(size, 8))
    return {k: torch.full_like(v, fill) for k, v in m.state_dict().items()}


class Replica:
    """A replica process (tests/weightsync/replica_proc.py) and what it reported."""

    def __init__(self, url: str, queue: str, rid: str, tmp: Path, *args: str):
        self.id, self.status = rid, tmp / f"{rid}.status"
        self.log = tempfile.NamedTemporaryFile(prefix=f"rollq-{rid}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.weightsync.replica_proc", url, queue, rid, str(self.status), *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ},
        )

    def lines(self) -> list[dict[str, Any]]:
        if self.popen.poll() is not None:
            raise AssertionError(f"replica {self.id} exited with {self.popen.returncode}: {self.stderr()}")
        text = self.status.read_text() if self.status.exists() else ""
        return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]  # whole lines only

    def versions(self) -> list[dict[str, Any]]:
        return [x for x in self.lines() if "version" in x]

    def serves(self, version: int) -> bool:
        v = self.versions()
        return bool(v) and v[-1]["version"] == version

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def cleanup(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture
def replicas(redis_url, queue, tmp_path):
    """``start(id, *args)`` -> a Replica process; every one is killed after the test."""
    made: list[Replica] = []

    def start(rid: str, *args: str) -> Replica:
        r = Replica(redis_url, queue, rid, tmp_path, *args)
        made.append(r)
        return r

    yield start
    for r in made:
        r.cleanup()


async def members(pub: WeightPublisher) -> set[str]:
    raw = await (await pub.redis()).hgetall(QueueKeys(pub.keys.queue).weights_members)
    return {k.decode() for k in raw}


async def has_members(pub: WeightPublisher, want: set[str]) -> bool:
    return await members(pub) == want


def at(r: Replica, version: int, fill: float) -> bool:
    """``r`` serves ``version``, and every weight of it is ``fill``: the whole version."""
    v = r.versions()
    return bool(v) and v[-1] == {"version": version, "lo": fill, "hi": fill}


async def test_replica_started_while_the_trainer_publishes_gets_the_next_version_before_it_serves(redis_url, queue, replicas):
    size = 32
    sender = BroadcastSender(backend="gloo", timeout=TIMEOUT, join_window=2.0)
    pub = WeightPublisher(redis_url, queue, sender=sender)  # no store: no memmap copy of any version
    a = replicas("a", "--delay-ms", "20")
    try:
        await until(lambda: any(x.get("event") == "serving" for x in a.lines()), 60, "replica a serving")
        rec1 = await pub.publish_weights(state(size, 1.0), transport="nccl")
        assert rec1.transport == "gloo" and rec1.timings["replicas"] == 1, rec1
        await until(lambda: at(a, 1, 1.0), 20, "replica a at version 1")

        b = replicas("b", "--delay-ms", "20")  # starts while version 1 is current: broadcast only
        await until(lambda: has_members(pub, {"a", "b"}), 60, "replica b registered as a member", interval=0.1)
        async with Producer(redis_url, queue) as p:
            early = await p.gather(await p.submit_many([{"prompt": f"e{i}", "sampling": {"max_tokens": 4}} for i in range(4)]), timeout=30)
            assert {r.replica for r in early} == {"a"} and {r.policy_version for r in early} == {(1, 1)}
            assert b.versions() == [] and not any(x.get("event") == "serving" for x in b.lines())  # waits, serves nothing

            rec2 = await pub.publish_weights(state(size, 2.0), transport="nccl")  # the same trainer, no restart
            assert rec2.transport == "gloo" and rec2.group != rec1.group, rec2
            assert rec2.timings["replicas"] == 2 and sender.group.members == {"a": 1, "b": 1}
            await until(lambda: at(a, 2, 2.0) and at(b, 2, 2.0), 20, "both replicas at version 2")
            await until(lambda: any(x.get("event") == "serving" for x in b.lines()), 20, "replica b serving")
            # b loaded version 2 whole before it started to pull
            assert b.lines()[:2] == [{"version": 2, "lo": 2.0, "hi": 2.0}, {"event": "serving"}], b.lines()
            late = await p.gather(await p.submit_many([{"prompt": f"l{i}", "sampling": {"max_tokens": 10}} for i in range(20)]), timeout=60)
            assert {r.replica for r in late} == {"a", "b"} and {r.policy_version for r in late} == {(2, 2)}

        rec3 = await pub.publish_weights(state(size, 3.0), transport="nccl")  # nobody came or went: the same group
        assert rec3.transport == "gloo" and rec3.group == rec2.group and rec3.timings["replicas"] == 2
        await until(lambda: at(a, 3, 3.0) and at(b, 3, 3.0), 20, "both replicas at version 3")
    finally:
        await pub.close()


async def test_replica_killed_mid_broadcast_costs_a_timeout_at_most_and_the_rest_get_the_version(redis_url, queue, replicas, tmp_path):
    size = 1024  # 4 MiB in 256 KiB buckets: more than the sockets buffer, so the sender is mid-way
    sender = BroadcastSender(backend="gloo", timeout=TIMEOUT, bucket_bytes=256 << 10, join_window=2.0)
    pub = WeightPublisher(redis_url, queue, sender=sender)  # no store: the version must arrive by broadcast
    marker = tmp_path / "paused"
    a = replicas("a", "--size", str(size))
    victim = replicas("v", "--size", str(size), "--pause-at", "2", "--marker", str(marker))
    try:
        for r in (a, victim):
            await until(lambda r=r: any(x.get("event") == "serving" for x in r.lines()), 60, f"replica {r.id} serving")
        rec1 = await pub.publish_weights(state(size, 1.0), transport="nccl")
        assert rec1.timings["replicas"] == 2, rec1
        await until(lambda: at(a, 1, 1.0) and at(victim, 1, 1.0), 20, "both replicas at version 1")

        publish = asyncio.create_task(pub.publish_weights(state(size, 2.0), transport="nccl"))
        await until(marker.exists, 30, "the victim to stop in the middle of version 2")
        assert not publish.done()
        victim.kill()
        # the broken broadcast (at once on gloo), a call the victim does not answer (join_window),
        # a new group and the same version again: bounded by the timeouts, never a hang
        rec2 = await asyncio.wait_for(publish, 2 * TIMEOUT + 2.0 + 10)
        assert rec2.version == 2 and rec2.transport == "gloo" and rec2.memmap_slot is None, rec2
        assert rec2.timings["replicas"] == 1 and rec2.timings["missing"] == 0, rec2.timings
        assert sender.group.members == {"a": 1} and await members(pub) == {"a"}  # the victim is out
        await until(lambda: at(a, 2, 2.0), 20, "the survivor at version 2")
        assert [x["version"] for x in a.versions()] == [1, 2]  # never anything in between

        rec3 = await pub.publish_weights(state(size, 3.0), transport="nccl")  # the new group carries on
        assert rec3.transport == "gloo" and rec3.group == rec2.group and rec3.timings["replicas"] == 1
        await until(lambda: at(a, 3, 3.0), 20, "the survivor at version 3")
    finally:
        await pub.close()


async def test_version_that_reached_some_workers_is_committed_for_them_and_the_others_load_a_memmap_copy(redis_url, queue, tmp_path):
    """In process (FakeWorkerEngine): one replica's worker fails its receive; the version is
    committed once, for the replica that acked, with a memmap copy the other one loads."""
    from rollq import Consumer
    from rollq.errors import WeightSyncError
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower

    size = 32
    root = str(tmp_path / "w")
    sender = BroadcastSender(backend="gloo", timeout=TIMEOUT, join_window=2.0)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engines = [FakeWorkerEngine(lambda: torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.Linear(size, 8))) for _ in range(2)]
    consumers = [Consumer(e, redis_url, queue, consumer_id=f"r{i}") for i, e in enumerate(engines)]
    followers = [WeightFollower(c, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True)) for c in consumers]

    def fill_of(e: FakeWorkerEngine) -> set[float]:
        return {float(v) for p in e.workers[0].model_runner.model.named_parameters() for v in p[1].detach().flatten().unique()}

    try:
        for f in followers:
            await f.start()
        rec1 = await pub.publish_weights(state(size, 1.0), transport="nccl")
        assert rec1.timings["replicas"] == 2 and rec1.memmap_slot is None
        await until(lambda: all(c.version == 1 for c in consumers), 20, "both at version 1")

        def broken(r: Any) -> None:
            raise WeightSyncError("test: this worker's copy is broken")

        engines[1].workers[0].rollq_state.receiver._complete = broken  # its receive of the next version fails
        rec2 = await pub.publish_weights(state(size, 2.0), transport="nccl")
        assert rec2.transport == "gloo" and rec2.group == rec1.group, rec2
        assert rec2.timings["replicas"] == 1 and rec2.timings["missing"] == 1 and rec2.memmap_slot is not None
        await until(lambda: all(c.version == 2 for c in consumers), 20, "both at version 2")
        assert fill_of(engines[0]) == {2.0} and fill_of(engines[1]) == {2.0}
        assert followers[0].history[-1].load.get("swap") == "broadcast"  # from what it received
        assert followers[1].history[-1].load.get("swap") != "broadcast"  # from the memmap copy
        rec3 = await pub.publish_weights(state(size, 3.0), transport="nccl")  # a member failed: a new group first
        assert rec3.group != rec2.group and rec3.timings["replicas"] == 2 and rec3.memmap_slot is None, rec3
        await until(lambda: all(c.version == 3 for c in consumers), 20, "both at version 3")
    finally:
        for f in followers:
            await f.stop()
        await pub.close()


async def test_a_broadcast_that_lands_before_the_replica_has_seen_its_join_is_applied(redis_url, queue):
    """In process: the trainer broadcasts as soon as the workers joined its group; the
    replica's own record of the join (a status poll of its workers, slow here) may come later.
    The version the workers acked is applied all the same, not taken for a missed broadcast."""
    from rollq import Consumer
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower

    size = 32
    engine = FakeWorkerEngine(lambda: torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.Linear(size, 8)))
    call_workers = engine.call_workers

    async def slow_status(method: str, *args: Any, **kw: Any) -> list[Any]:
        if method == WorkerRpc.RECEIVE_STATUS:
            await asyncio.sleep(2.0)
        return await call_workers(method, *args, **kw)

    engine.call_workers = slow_status  # type: ignore[method-assign]
    consumer = Consumer(engine, redis_url, queue, consumer_id="slow")
    follower = WeightFollower(consumer, WeightSyncSettings(reconcile_interval=0.2, broadcast=True))
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=TIMEOUT, join_window=1.0)
    pub = WeightPublisher(redis_url, queue, sender=sender)
    try:
        await follower.start()
        rec = await pub.publish_weights(state(size, 1.0), transport="nccl")  # no store: broadcast only
        assert rec.transport == "gloo" and rec.timings["replicas"] == 1, rec
        assert follower.receiver.group != rec.group  # the replica has not seen its join yet
        await until(lambda: consumer.version == 1, 10, "the replica at version 1")
        assert follower.history[-1].load.get("swap") == "broadcast"
    finally:
        await follower.stop()
        await pub.close()
