"""Weight sync protocol with in-process fake workers (the vLLM path: tests/weightsync/test_vllm.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import pytest
import torch

from rollq import Consumer, EchoEngine, Producer, ProducerSettings, StalenessBound
from rollq.protocol import Job, SamplingParams, pack_i32
from rollq.errors import CorruptWeights, StaleVersion, WeightSyncError
from rollq.keys import QueueKeys
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.settings import WeightSyncSettings
from rollq.weightsync import MemmapStore, VersionRecord, WeightFollower, WeightPublisher, commit_version, read_version
from rollq.weightsync.nccl import BroadcastSender, GroupInfo
from tests.helpers import until, until_sync


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))


def state(fill: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, fill) for k, v in small_model().state_dict().items()}


def weight0(engine: FakeWorkerEngine, i: int = 0) -> float:
    return float(engine.workers[i].model_runner.model.module[0].weight[0, 0].detach())


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "weights")


# -- memmap store -------------------------------------------------------------------------
def test_memmap_roundtrip_reuses_slots_and_refuses_corruption(root):
    store = MemmapStore(root)
    info1 = store.write(1, state(1.0))
    info2 = store.write(2, state(2.0))
    assert {info1.slot, info2.slot} == {"slot-0", "slot-1"}
    items = dict(store.read(info2.slot, version=2, checksum=info2.checksum))
    assert float(items["0.weight"][0, 0]) == 2.0
    # version 3 rewrites version 1's slot in place: version 1 is gone, 2 still readable
    info3 = store.write(3, state(3.0))
    assert info3.slot == info1.slot
    with pytest.raises(CorruptWeights, match="holds version 3"):
        store.read(info1.slot, version=1, checksum=info1.checksum)
    store.read(info2.slot, version=2, checksum=info2.checksum)
    # flip bytes inside a tensor file: the checksum refuses it
    path = os.path.join(root, info3.slot, "0.weight.memmap")
    with open(path, "r+b") as f:
        f.seek(16)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CorruptWeights, match="checksum"):
        store.read(info3.slot, version=3, checksum=info3.checksum)


def test_half_written_slot_and_paths_outside_root_are_refused(root):
    store = MemmapStore(root)
    info = store.write(4, state(4.0))
    os.remove(os.path.join(root, info.slot, "COMMIT"))  # as if the writer died before committing
    with pytest.raises(CorruptWeights, match="no commit marker"):
        store.read(info.slot, version=4, checksum=info.checksum)
    for bad in ("../etc", "/etc/passwd", "slot-0/../../x", "other"):
        with pytest.raises(WeightSyncError, match="outside"):
            store.path(bad)


# -- versions ----------------------------------------------------------------------------
async def test_versions_are_monotonic(redis_client, queue):
    keys = QueueKeys(queue)
    rec = lambda v: VersionRecord(version=v, transport="memmap", checksum="0", num_tensors=0, nbytes=0)  # noqa: E731
    assert await commit_version(redis_client, keys, rec(2))
    assert not await commit_version(redis_client, keys, rec(2))  # duplicate ignored
    assert not await commit_version(redis_client, keys, rec(1))  # older ignored
    assert (await read_version(redis_client, keys)).version == 2
    assert await redis_client.xlen(keys.versions_log) == 1


async def test_publish_older_version_is_refused(redis_url, queue, root):
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0), version=5)
    with pytest.raises(StaleVersion):
        await pub.publish_weights(state(2.0), version=5)
    assert (await pub.publish_weights(state(2.0))).version == 6
    await pub.close()


# -- follower ----------------------------------------------------------------------------
async def test_restarted_replica_catches_up_before_pulling_and_missed_hint_is_reconciled(redis_url, queue, root):
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    await pub.publish_weights(state(2.0))
    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3))
    await follower.start()
    assert consumer.version == 2 and weight0(engine) == 2.0  # before the consumer pulled anything
    # A version committed without its pub/sub hint (as if the message was dropped).
    info = pub.store.write(3, state(3.0))
    rec = VersionRecord(version=3, transport="memmap", checksum=info.checksum, num_tensors=4, nbytes=info.nbytes, memmap_slot=info.slot)
    c = pub._client
    await c.hset(QueueKeys(queue).version, mapping={"v": 3, "d": msgspec.msgpack.encode(rec)})
    await until(lambda: consumer.version == 3, 5, "reconcile of a version without announcement")
    assert weight0(engine) == 3.0
    await follower.stop()
    await pub.close()


async def test_stop_ends_the_follower_even_when_an_announcement_lands_with_the_cancellation(redis_url, queue, root):
    """On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives just after the
    announcement woke its inner wait; the follower's loop then went on and ``stop()`` waited for
    it for ever (a CI run hung 600 s in stop()). Here the announcement and the stop land in
    exactly that order."""
    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=30))
    await follower.start()
    await asyncio.sleep(0.05)  # the loop is in its wait for the next announcement
    follower._kick.set()  # the inner wait is woken and finishes first ...
    await asyncio.sleep(0)
    stopping = asyncio.create_task(follower.stop())  # ... then the cancellation arrives
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert stopping in done, "stop() did not end the follower's loop"
    assert follower._task is not None and follower._task.done()


@pytest.mark.parametrize("policy", ["keep", "abort", "drain"])
async def test_update_policies_and_version_spans(redis_url, queue, root, policy):
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    engine = FakeWorkerEngine(small_model, delay_per_token=0.02)  # 20 tokens: 0.4 s per job
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.2))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    async with Producer(redis_url, queue) as p:
        await p.set_update_policy(policy)
        hs = await p.submit_many([{"prompt": f"q{i}", "sampling": {"max_tokens": 20}} for i in range(6)])
        await until(lambda: consumer.running_count() == 6, 10, "jobs running")
        await pub.publish_weights(state(2.0))
        rs = await p.gather(hs, timeout=30)
        after = await (await p.submit("after", sampling={"max_tokens": 2}))
    consumer.stop()
    await task
    await follower.stop()
    await pub.close()
    spans = {r.policy_version for r in rs}
    assert all(r.ok for r in rs)
    if policy == "keep":
        # Running across the update: each records where version 2 began. The echo engine
        # makes every token when a job starts, so version 2 made none of them and the result
        # does not claim it.
        assert spans == {(1, 1)} and all(s.versions == [(1, 0), (2, 20)] for r in rs for s in r.samples)
    elif policy == "abort":
        assert spans == {(2, 2)}  # restarted from scratch on the new weights
        assert all(r.deliveries == 1 for r in rs)  # never went back to Redis: no duplicate
    else:
        assert spans == {(1, 1)}  # finished on the old weights before the load
    assert after.policy_version == (2, 2)
    st = follower.history[-1]
    assert st.version == 2 and st.policy == policy and st.pause_s >= 0
    assert weight0(engine) == 2.0


async def test_an_update_records_its_timeline_from_the_announcement_to_serving(redis_url, queue, root):
    """Each update says when, in wall-clock time, its announcement arrived, the reconcile
    began, staging began, intake closed for the swap and the update was recorded, in that
    order and consistent with the measured staging and pause (the gaps between them are the
    waits for the consumer's event loop that the durations do not cover)."""
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    engine = FakeWorkerEngine(small_model, delay_per_token=0.02)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=30.0))  # only the announcement wakes it
    await follower.start()
    task = asyncio.create_task(consumer.run())
    try:
        async with Producer(redis_url, queue) as p:
            hs = await p.submit_many([{"prompt": f"q{i}", "sampling": {"max_tokens": 20}} for i in range(4)])
            await until(lambda: consumer.running_count() == 4, 10, "jobs running")
            t_publish = time.time()
            rec = await pub.publish_weights(state(2.0))
            await until(lambda: consumer.version == rec.version and follower.history, 10, "the update")
            await p.gather(hs, timeout=30)
    finally:
        consumer.stop()
        await task
        await follower.stop()
        await pub.close()
    t = follower.history[-1].timings
    order = ["hinted_at", "woke_at", "staging_at", "swap_at", "recorded_at"]
    marks = [t[k] for k in order]
    assert t_publish <= marks[0], (t_publish, t)  # woken by the announcement, not by polling
    assert marks == sorted(marks), dict(zip(order, marks))
    slack = 0.005  # durations are perf_counter, marks wall clock
    assert t["staging_at"] + t["stage_call_s"] <= t["swap_at"] + slack, t
    assert t["swap_at"] + follower.history[-1].pause_s <= t["recorded_at"] + slack, t
    assert t["recorded_at"] - t["hinted_at"] < 10
    w = follower.history[-1].waits()  # consecutive parts: they add up to announcement -> recorded
    assert min(w.values()) >= -slack and abs(sum(w.values()) - (t["recorded_at"] - t["hinted_at"])) < 1e-6, w


async def test_job_requiring_newer_version_waits_for_it(redis_url, queue, root):
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.2))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    async with Producer(redis_url, queue) as p:
        h = await p.submit("needs v2", min_version=2, sampling={"max_tokens": 2})
        await until(lambda: consumer.versions.waiting, 10, "the replica to hold the job for version 2")
        assert not h.done()  # the replica holds it: it is at version 1
        await pub.publish_weights(state(2.0))
        r = await h.result(timeout=10)
    consumer.stop()
    await task
    await follower.stop()
    await pub.close()
    assert r.policy_version == (2, 2)


# -- staleness bound ---------------------------------------------------------------------
async def test_staleness_admission_is_atomic_and_follows_versions(redis_url, queue, root):
    pub = WeightPublisher(redis_url, queue, root=root)
    async with Producer(redis_url, queue, settings=ProducerSettings(block_when_full=False)) as p:
        await p.set_staleness_bound(max_lag=1, batch=4)  # (1 + version + 1) * 4 jobs in total
        await p.submit_many([{"prompt": "x"}] * 8)  # version 0: 8 allowed
        with pytest.raises(StalenessBound):
            await p.submit("one too many")
        assert p.outstanding == 8
        await pub.publish_weights(state(1.0))  # version 1: 12 allowed
        await p.submit_many([{"prompt": "x"}] * 4)
        with pytest.raises(StalenessBound):
            await p.submit("again too many")
    # A blocking producer waits for the next version instead of failing.
    async with Producer(redis_url, queue) as p2:
        waiter = asyncio.create_task(p2.submit("waits"))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        await pub.publish_weights(state(2.0))
        h = await asyncio.wait_for(waiter, 5)
        assert not h.duplicate
    await pub.close()


# -- broadcast (gloo here, NCCL on GPUs) -------------------------------------------------
@pytest.mark.parametrize("mode,verify", [("packed", True), ("direct", False)])
async def test_gloo_broadcast_updates_every_worker_of_every_replica(redis_url, queue, root, mode, verify):
    sender = BroadcastSender(num_workers=3, backend="gloo", timeout=20, bucket_bytes=2048, mode=mode, verify=verify)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engines = [FakeWorkerEngine(small_model, num_workers=2), FakeWorkerEngine(small_model, num_workers=1)]
    consumers = [Consumer(e, redis_url, queue) for e in engines]
    followers = [WeightFollower(c, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True)) for c in consumers]
    for f in followers:
        await f.start()
    rec = await pub.publish_weights(state(7.0), transport="nccl")
    assert rec.transport == "gloo" and rec.memmap_slot is None and rec.timings["replicas"] == 3
    await until(lambda: all(c.version == rec.version for c in consumers), 10, "replicas at the new version")
    assert [weight0(e, i) for e in engines for i in range(e.num_workers)] == [7.0, 7.0, 7.0]
    assert all(f.history[-1].transport == "gloo" for f in followers)
    rec2 = await pub.publish_weights(state(8.0), transport="nccl")  # same group, staging reused
    await until(lambda: all(c.version == rec2.version for c in consumers), 10, "second update")
    assert weight0(engines[1]) == 8.0
    for f in followers:
        await f.stop()
    await pub.close()


class Loadable(torch.nn.Sequential):
    """A model with vLLM's ``load_weights`` entry point (checkpoint names -> parameters)."""

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return set(params)


def loadable_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = Loadable(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    for p in m.parameters():
        p.requires_grad_(False)
    return m


async def test_broadcast_streams_into_shadow_weights_and_swaps(redis_url, queue, root, monkeypatch):
    monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")  # "auto" uses them on GPUs only
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=20, mode="direct", verify=True)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engine = FakeWorkerEngine(loadable_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True))
    await follower.start()
    worker = engine.workers[0]
    live = worker.model_runner.model
    for fill in (7.0, 8.0):
        rec = await pub.publish_weights(state(fill), transport="nccl")
        assert rec.transport == "gloo"
        await until(lambda: consumer.version == rec.version, 10, "replica at the new version")
        assert follower.history[-1].load["swap"] == "shadow", follower.history[-1].load
        assert all(bool((p == fill).all()) for p in live.parameters())
        # the first version loads through load_weights (traced: it records the load plan),
        # the next is received straight into the shadow's bytes, with no staging buffer
        assert worker.rollq_state.receiver.status.in_place == (fill == 8.0)
        assert (worker.rollq_state.receiver.flat is None) == (fill == 8.0)
    assert worker.rollq_state.shadow.synced and worker.rollq_state.shadow.plan is not None
    # a memmap version also loads into the shadow while staging, then swaps in
    rec = await pub.publish_weights(state(9.0), transport="memmap")
    await until(lambda: consumer.version == rec.version, 10, "memmap version")
    assert follower.history[-1].load["swap"] == "shadow" and float(live[0].weight[0, 0]) == 9.0
    await follower.stop()
    await pub.close()


@pytest.mark.parametrize("shadow_layout", [False, True])
async def test_overlapped_swap_through_a_broadcast_and_its_undo_when_the_commit_is_late(redis_url, queue, root, monkeypatch, shadow_layout):
    import rollq.weightsync.trainer.publisher as publisher_mod

    monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")  # "auto" uses them on GPUs only
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=20, mode="direct", bucket_bytes=4096, shadow_layout=shadow_layout)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engine = FakeWorkerEngine(loadable_model)
    consumer = Consumer(engine, redis_url, queue)
    # a lead longer than any receive here: the swap starts as soon as the offer is seen; the
    # commit may come late on a loaded machine (the undo below shortens the wait for it)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True, swap_overlap=True,
                              overlap_lead_s=5.0, overlap_commit_timeout=5.0))
    await follower.start()
    run = asyncio.create_task(consumer.run())  # its control channel brings the offers' hints
    live = engine.workers[0].model_runner.model
    try:
        swaps = []
        for fill in (1.0, 2.0, 3.0, 4.0):
            rec = await pub.publish_weights(state(fill), transport="nccl")
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            assert all(bool((p == fill).all()) for p in live.parameters())
            swaps.append(follower.history[-1].load["swap"])
        # 1: staged and loaded (the plan), 2: in place (this replica learns how long its
        # receives take), then swapped in part by part while arriving
        assert swaps == ["shadow", "shadow", "overlap", "overlap"], swaps
        assert [h.transport for h in follower.history] == ["gloo"] * 4  # the group's backend, overlapped or not
        assert rec.timings["layout_mode"] == float(shadow_layout)
        st = follower.history[-1]
        assert st.load["parts"] >= 2 and st.pause_s > 0 and consumer.version == 4

        # the trainer commits late: the overlapped swap is undone, then the committed version
        # goes live the usual way
        commit = publisher_mod.commit_version

        async def late_commit(*a, **kw):
            await asyncio.sleep(0.4)
            return await commit(*a, **kw)

        monkeypatch.setattr(publisher_mod, "commit_version", late_commit)
        follower.overlap.commit_timeout = 0.1
        rec = await pub.publish_weights(state(5.0), transport="nccl")
        await until(lambda: consumer.version == rec.version, 10, "version 5")
        assert follower.overlap.reverts == 1 and follower.history[-1].load["swap"] == "shadow"
        assert all(bool((p == 5.0).all()) for p in live.parameters())
    finally:
        consumer.stop()
        await asyncio.wait_for(run, 10)
        await follower.stop()
        await pub.close()


PEER = r"""
import sys, msgspec, torch, os
from rollq.weightsync.nccl import GroupInfo, make_group
print("ready", flush=True)
line = sys.stdin.readline().split()  # imports done first: the group is offered only now
info = msgspec.msgpack.decode(bytes.fromhex(line[0]), type=GroupInfo)
g = make_group(info, int(line[1]))
g.broadcast(torch.zeros(1, dtype=torch.uint8), info.timeout)
buf = torch.empty(int(sys.argv[1]), dtype=torch.uint8)
g.broadcast(buf, info.timeout)   # the first bucket arrives...
os._exit(9)                      # ...then the peer dies mid-broadcast
"""


async def test_peer_dying_mid_broadcast_times_out_and_falls_back_to_memmap(redis_url, queue, root):
    async with asyncio.timeout(200):  # every step below is bounded; this bounds them all
        await _peer_dies_mid_broadcast(redis_url, queue, root)


async def _peer_dies_mid_broadcast(redis_url: str, queue: str, root: str) -> None:
    keys = QueueKeys(queue)
    # at least 2 workers: once the peer is gone no group can form, and the version goes by memmap
    sender = BroadcastSender(num_workers=2, backend="gloo", timeout=15, bucket_bytes=1024)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True))
    await follower.start()

    # The peer process starts (and imports torch) before the trainer opens its group.
    proc = subprocess.Popen([sys.executable, "-c", PEER, "1024"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)).strip() == "ready"
    except BaseException:
        proc.kill()
        raise

    async def peer() -> None:  # answers the group's call as replica "peer", then joins at its rank
        raw = await pub.redis()
        deadline = time.monotonic() + 60
        while not (call := await raw.hget(keys.weights_group, "call")):
            assert time.monotonic() < deadline, "the trainer never called a group"
            await asyncio.sleep(0.02)
        await raw.hset(keys.weights_answers(call.decode()), "peer", "1 peer-run")
        while not (d := await raw.hget(keys.weights_group, "d")):
            assert time.monotonic() < deadline, "the trainer never formed the group"
            await asyncio.sleep(0.02)
        rank = msgspec.msgpack.decode(d, type=GroupInfo).ranks["peer"]
        proc.stdin.write(f"{d.hex()} {rank}\n")
        proc.stdin.flush()

    try:
        peer_task = asyncio.create_task(peer())
        t0 = time.monotonic()
        rec = await asyncio.wait_for(pub.publish_weights(state(9.0), transport="nccl"), 180)
        elapsed = time.monotonic() - t0
        await asyncio.wait_for(peer_task, 10)
        assert await asyncio.to_thread(proc.wait, 30) == 9  # it joined, took the first bucket, and died
    finally:
        proc.kill()
    assert rec.transport == "memmap" and rec.timings.get("nccl_failed") == 1.0
    assert elapsed < 15 * 5 + 10  # bounded by the timeouts, not a hang
    assert sender.group.pg is None  # the group is dropped and rebuilt next time
    await until(lambda: consumer.version == rec.version, 10, "replica loads the memmap fallback")
    assert weight0(engine) == 9.0
    await follower.stop()
    await pub.close()


def test_group_info_roundtrip():
    gi = GroupInfo(id="x", host="127.0.0.1", port=1, world_size=3, backend="gloo", timeout=1.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(gi), type=GroupInfo) == gi
    assert EchoEngine().tp_size == 1  # an echo replica is one broadcast receiver (Engine.tp_size)


class ScriptedGroup:
    """Stands in for the broadcast group on the receiving side: each broadcast delivers the
    next tensor of ``sent`` (rank 0's bytes); ``fail_at`` makes that broadcast raise."""

    def __init__(self, sent: list[torch.Tensor], fail_at: int | None = None, hold_at: int | None = None):
        self.flats = [t.contiguous().reshape(-1).view(torch.uint8) for t in sent]
        self.fail_at, self.n = fail_at, 0
        self.hold_at, self.release = hold_at, threading.Event()  # broadcast ``hold_at`` waits for release

    def _one(self, buf: torch.Tensor) -> None:
        if self.n == self.hold_at:
            assert self.release.wait(10)
        if self.n == self.fail_at:
            raise RuntimeError("peer died mid-broadcast")
        buf.copy_(self.flats[self.n])
        self.n += 1

    def broadcast(self, buf, timeout, wait=True):
        self._one(buf)

    def broadcast_many(self, bufs, timeout, *, coalesce):
        for b in bufs:
            self._one(b)


def scripted_receiver(monkeypatch) -> tuple[Any, torch.nn.Module, Any]:
    """A fake worker with shadow weights and a receiver whose group is scripted (not formed):
    ``(worker, its live model, receiver)``; set ``receiver.pg`` to a :class:`ScriptedGroup`."""
    from rollq.weightsync.worker._receiver import WorkerReceiver

    monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")
    worker = FakeWorkerEngine(loadable_model).workers[0]
    info = GroupInfo(id="g", host="", port=0, world_size=2, backend="gloo", timeout=5)
    rcv = WorkerReceiver(info, 1, torch.device("cpu"), ScriptedGroup([]), sink=worker.rollq_state)
    worker.rollq_state.receiver = rcv
    return worker, worker.model_runner.model, rcv


def scripted_version(live: torch.nn.Module, fill: float) -> tuple[Any, list[torch.Tensor]]:
    """The offer of version ``int(fill)`` (every tensor of ``live`` filled with ``fill``,
    one broadcast per tensor) and the tensors rank 0 sends."""
    from rollq.weightsync.memmap import manifest_of
    from rollq.weightsync.wire import Offer

    items = [(k, torch.full_like(v, fill)) for k, v in live.state_dict().items()]
    offer = Offer(version=int(fill), group="g", checksum="", bucket_bytes=1 << 20, manifest=manifest_of(items),
                  timeout=5, mode="direct")
    return offer, [t for _, t in items]


def test_in_place_receive_that_fails_leaves_nothing_to_swap_and_the_next_one_works(monkeypatch):
    worker, live, rcv = scripted_receiver(monkeypatch)

    def receive(fill: float, fail_at: int | None = None) -> None:
        offer, sent = scripted_version(live, fill)
        rcv.pg = ScriptedGroup(sent, fail_at)
        rcv.receive(offer)

    receive(1.0)  # staged and loaded through load_weights, traced: the plan
    assert rcv.status.state == "staged" and not rcv.status.in_place
    assert worker.rollq_apply_staged(1)["swap"] == "shadow" and all(bool((p == 1.0).all()) for p in live.parameters())

    receive(2.0, fail_at=2)  # in place, then the group breaks part way
    sh = worker.rollq_state.shadow
    assert rcv.status.state == "failed" and "peer died" in str(rcv.status.error)
    assert sh.version is None and not sh.synced  # half a version: nothing to swap in
    assert worker.rollq_state.lock.acquire(blocking=False)  # the target gave the lock back
    worker.rollq_state.lock.release()
    with pytest.raises(WeightSyncError, match="not staged"):
        worker.rollq_apply_staged(2)
    assert all(bool((p == 1.0).all()) for p in live.parameters())  # live never saw version 2

    receive(3.0)  # in place again (the shadow is synced from live first)
    assert rcv.status.state == "staged" and rcv.status.in_place
    worker.rollq_apply_staged(3)
    assert all(bool((p == 3.0).all()) for p in live.parameters())


def test_staged_receive_that_breaks_while_the_shadow_loads_it_is_not_taken_for_a_whole_version(monkeypatch):
    """The shadow weights load a staged version as it arrives; the group breaks part way and
    the shadow gives up on the version: the receive still fails, nothing is swapped in."""
    worker, live, rcv = scripted_receiver(monkeypatch)
    before = [p.detach().clone() for p in live.parameters()]
    offer, sent = scripted_version(live, 1.0)
    rcv.pg = ScriptedGroup(sent, fail_at=2)
    rcv.receive(offer)
    assert rcv.status.state == "failed" and "peer died" in str(rcv.status.error), rcv.status
    assert not rcv.status.ack("r/0").ok
    with pytest.raises(WeightSyncError, match="not staged"):
        worker.rollq_apply_staged(1)
    assert all(torch.equal(p, b) for p, b in zip(live.parameters(), before))  # live never saw version 1


def test_overlapped_swap_goes_live_part_by_part_and_is_undone_on_failure_or_without_commit(monkeypatch):
    worker, live, rcv = scripted_receiver(monkeypatch)

    def values() -> set[float]:
        return {float(v) for p in live.parameters() for v in p.flatten().unique()}

    def start(fill: float, **kw) -> tuple[threading.Thread, ScriptedGroup]:
        offer, sent = scripted_version(live, fill)
        rcv.pg = ScriptedGroup(sent, **kw)
        th = threading.Thread(target=rcv.receive, args=(offer,))
        th.start()
        return th, rcv.pg

    th, _ = start(1.0)  # staged and loaded through load_weights (traced: the plan), swapped normally
    th.join()
    worker.rollq_apply_staged(1)
    assert values() == {1.0}

    # the receive breaks after two of its four tensors: what was swapped in goes back
    th, g = start(2.0, fail_at=2, hold_at=2)
    out: dict = {}
    swap = threading.Thread(target=lambda: out.update(worker.rollq_swap_overlapped(2, commit_timeout=1.0)))
    swap.start()
    assert until_sync(lambda: values() == {1.0, 2.0}, 5.0, "parts 0 and 1 live")  # parts 0 and 1 are live already (generation is paused)
    g.release.set()
    th.join()
    swap.join()
    assert out["swap"] == "reverted" and "receive failed" in out["why"], out
    assert values() == {1.0} and worker.rollq_version() == 1

    # a part that never completes on the device (its event stays pending): the swap gives up
    # after receive_timeout and aborts the group, which ends the transfer behind those events
    from rollq.weightsync.worker._receiver import ReceiveProgress

    class Pending:
        def query(self) -> bool:
            return False

    add = ReceiveProgress.add
    monkeypatch.setattr(ReceiveProgress, "add", lambda self, ev: add(self, Pending()))
    th, g = start(2.0, hold_at=2)
    aborted = threading.Event()
    g.abort = aborted.set
    out = worker.rollq_swap_overlapped(2, commit_timeout=1.0, receive_timeout=0.2)
    assert th.is_alive(), "the undo did not wait for the stuck receive"
    assert out["swap"] == "reverted" and aborted.is_set() and values() == {1.0}, out
    g.release.set()  # what the abort does to a real transfer: it ends
    th.join()
    assert rcv.status.state == "failed" and "abandoned" in str(rcv.status.error), rcv.status
    assert worker.rollq_state.shadow.version is None  # nothing to swap in from that receive
    monkeypatch.setattr(ReceiveProgress, "add", add)

    # received whole, but never committed: undone too, and still staged in the shadow
    th, _ = start(3.0)
    th.join()
    out = worker.rollq_swap_overlapped(3, commit_timeout=0.05)
    assert out["swap"] == "reverted" and "not committed" in out["why"], out
    assert values() == {1.0} and worker.rollq_state.shadow.version == 3
    rcv.on_control("version 3")  # the announcement: the same version now goes live
    out = worker.rollq_swap_overlapped(3, commit_timeout=1.0)
    assert out["swap"] == "overlap" and out["parts"] == 4, out
    assert values() == {3.0} and worker.rollq_version() == 3
    sh = worker.rollq_state.shadow
    assert sh.version is None and not sh.synced  # the shadow holds version 1's bytes now

    # the next version is written without syncing the shadow first (only the plan's bytes
    # differ), and goes live through the usual swap
    th, _ = start(4.0)
    th.join()
    assert rcv.status.in_place and worker.rollq_apply_staged(4)["swap"] == "shadow"
    assert values() == {4.0}
    # no in-place receive of that version: nothing to do here
    assert worker.rollq_swap_overlapped(9, start_timeout=0.01)["swap"] == "none"


async def test_receivers_report_their_shadow_layout_and_the_trainer_packs_buckets_that_way(redis_url, queue, root, monkeypatch):
    monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")  # "auto" uses them on GPUs only
    sender = BroadcastSender(num_workers=3, backend="gloo", timeout=20, mode="direct", bucket_bytes=4096, shadow_layout=True)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    engines = [FakeWorkerEngine(loadable_model, num_workers=2), FakeWorkerEngine(loadable_model)]
    consumers = [Consumer(e, redis_url, queue) for e in engines]
    followers = [WeightFollower(c, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True)) for c in consumers]
    for f in followers:
        await f.start()
    workers = [w for e in engines for w in e.workers]
    keys = QueueKeys(queue)
    client = await pub.redis()

    async def publish(fill: float) -> VersionRecord:
        rec = await pub.publish_weights(state(fill), transport="nccl")
        assert rec.transport == "gloo", rec
        await until(lambda: all(c.version == rec.version for c in consumers), 10, f"version {rec.version}")
        for w in workers:
            assert all(bool((p == fill).all()) for p in w.model_runner.model.parameters())
        return rec

    try:
        rec = await publish(1.0)  # per tensor; loaded through load_weights, traced: each shadow goes flat
        assert rec.timings["layout_mode"] == 0.0
        assert len(await client.hgetall(keys.weights_layouts)) == 3
        for fill in (2.0, 3.0):  # every receiver reported the same layout: buckets land in place
            rec = await publish(fill)
            assert rec.timings["layout_mode"] == 1.0 and rec.timings["receivers_in_place"] == 1.0, rec.timings
        # a receiver whose shadow is gone (restarted, out of memory) still takes part: it stages
        # the buckets and loads them at the swap
        workers[2].rollq_state.drop_shadow("test")
        rec = await publish(4.0)
        assert rec.timings["layout_mode"] == 1.0 and rec.timings["receivers_in_place"] == 2 / 3, rec.timings
        assert followers[1].history[-1].load["swap"] == "broadcast"
        # layouts that disagree: back to one broadcast per tensor
        await client.hset(keys.weights_layouts, "other/0", b"\x80")
        rec = await publish(5.0)
        assert rec.timings["layout_mode"] == 0.0
    finally:
        for f in followers:
            await f.stop()
        await pub.close()


@pytest.mark.parametrize("n", [1, 2])
async def test_abort_resume_continues_from_the_partial_tokens(redis_url, queue, root, n):
    """``abort`` with ``abort_resume``: each job keeps the 5 tokens per sample it had
    (``abort_at``) and continues on version 2 from prompt + those tokens; the result is the
    old tokens then the continuation, with versions and logprobs stitched at the boundary."""
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    engine = FakeWorkerEngine(small_model, delay_per_token=0.05, abort_at=5)  # 20 tokens: 1 s per job
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.2, abort_resume=True))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    jobs = [{"prompt": f"q{i}", "sampling": {"max_tokens": 20, "n": n, "logprobs": 0}} for i in range(4)]
    seeded = {"prompt": "qs", "sampling": {"max_tokens": 20, "seed": 7}}
    async with Producer(redis_url, queue) as p:
        await p.set_update_policy("abort")
        hs = await p.submit_many([*jobs, seeded])
        await until(lambda: consumer.running_count() == 5, 10, "jobs running")
        await pub.publish_weights(state(2.0))
        rs = await p.gather(hs, timeout=30)
    consumer.stop()
    await task
    await follower.stop()
    await pub.close()
    assert all(r.ok and r.deliveries == 1 for r in rs)
    echo = EchoEngine()
    for spec, r in zip(jobs, rs[:4]):
        assert r.policy_version == (1, 2)
        whole = echo.generate_now(Job(id="x", reply="p", text=spec["prompt"], sampling=SamplingParams(max_tokens=20, n=n)))
        prompt = list(spec["prompt"].encode())
        for j, s in enumerate(r.samples):
            old = whole.samples[j].token_ids[:5]  # what version 1 had generated
            cont = echo.generate_now(Job(id="x", reply="p", tokens=pack_i32(prompt + old), sampling=SamplingParams(max_tokens=15)))
            assert s.token_ids == old + cont.samples[0].token_ids
            assert r.token_versions(j) == [1] * 5 + [2] * 15 and s.versions == [(1, 0), (2, 5)]
            assert s.token_logprobs is not None and len(s.token_logprobs) == 20
            assert s.finish_reason == "length"
    # A seeded job runs again from scratch: its random stream cannot be continued.
    assert rs[4].policy_version == (2, 2) and rs[4].token_versions() == [2] * 20


async def test_abort_resume_twice_stitches_three_versions(redis_url, queue, root):
    """A resumed job aborted again by the next update keeps what its continuation made too:
    its sample reads 5 tokens of version 1, 5 of version 2, the rest of version 3."""
    pub = WeightPublisher(redis_url, queue, root=root)
    await pub.publish_weights(state(1.0))
    engine = FakeWorkerEngine(small_model, delay_per_token=0.05, abort_at=5)  # 40 tokens: 2 s
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.2, abort_resume=True))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    async with Producer(redis_url, queue) as p:
        await p.set_update_policy("abort")
        h = await p.submit("q", sampling={"max_tokens": 40, "logprobs": 0})
        await until(lambda: consumer.running_count() == 1, 10, "job running")
        await pub.publish_weights(state(2.0))
        await until(lambda: consumer.version == 2, 10, "version 2 served")
        await pub.publish_weights(state(3.0))  # while the continuation (35 tokens, 1.75 s) runs
        r = await h.result(timeout=30)
    consumer.stop()
    await task
    await follower.stop()
    await pub.close()
    assert r.ok and r.policy_version == (1, 3) and r.deliveries == 1
    assert r.token_versions() == [1] * 5 + [2] * 5 + [3] * 30
    s = r.samples[0]
    assert s.versions == [(1, 0), (2, 5), (3, 10)] and len(s.token_ids) == len(s.token_logprobs or []) == 40
