"""Weight sync on GPUs: shadow weights, the load plan, in-place NCCL receive and memmap reads.

Skipped without a GPU (the broadcast test needs two). The same protocol runs on CPU over gloo
in tests/weightsync/test_fake_workers.py; these cover what only exists on CUDA: coalesced NCCL groups,
page-locked memmap reads and writes into the shadow's own bytes.
"""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch

from rollq import Consumer
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.settings import WeightSyncSettings
from rollq.weightsync import WeightFollower, WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from tests.helpers import until

pytestmark = pytest.mark.gpu


class Fused(torch.nn.Module):
    """q/k/v checkpoint tensors land in one fused parameter, as in vLLM's QKVParallelLinear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(3 * 64, 32, dtype=torch.bfloat16), requires_grad=False)
        self.out = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        for name, t in weights:
            if name == "out":
                self.out.data.copy_(t)
            else:
                i = "qkv".index(name)
                self.qkv.data.narrow(0, i * 64, 64).copy_(t)
        return {"qkv", "out"}


def ckpt(fill: float, device: str) -> dict[str, torch.Tensor]:
    out = {n: torch.full((64, 32), fill + i, dtype=torch.bfloat16, device=device) for i, n in enumerate("qkv")}
    out["out"] = torch.full((32, 64), -fill, dtype=torch.bfloat16, device=device)
    return out


def check(engine: FakeWorkerEngine, fill: float) -> None:
    m = engine.workers[0].model_runner.model
    for i in range(3):
        assert bool((m.qkv[i * 64 : (i + 1) * 64] == fill + i).all())
    assert bool((m.out == -fill).all())


@pytest.fixture
def shm_root():
    root = f"/dev/shm/rollq-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_memmap_versions_are_read_straight_into_the_shadow(redis_url, queue, shm_root):
    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3))
    await follower.start()
    pub = WeightPublisher(redis_url, queue, root=shm_root)
    try:
        for fill in (1.0, 2.0, 3.0, 4.0):
            rec = await pub.publish_weights(ckpt(fill, "cuda:0"), transport="memmap")
            await until(lambda: consumer.version == rec.version, 60, f"version {rec.version}")
            load = follower.history[-1].load
            assert load["swap"] == "shadow", load
            check(engine, fill)
            # the first version loads through load_weights (traced: the plan), later ones are
            # copied from the page-locked files into the shadow's bytes
            assert bool(load.get("in_place")) == (fill > 1.0), load
    finally:
        await follower.stop()
        await pub.close()


@pytest.mark.parametrize("shadow_layout", [False, True])
async def test_nccl_versions_are_received_into_the_shadow_in_coalesced_groups(redis_url, queue, shm_root, shadow_layout):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    engine = FakeWorkerEngine(Fused, device="cuda:1")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, broadcast=True))
    await follower.start()
    # 3 groups of tensors (group_bytes below one q/k/v tensor pair): coalescing is exercised
    # (with shadow_layout, versions after the first go as buckets of the receiver's flat layout)
    sender = BroadcastSender(1, backend="nccl", timeout=60, device="cuda:0", group_bytes=2 * 64 * 32 * 2,
                             bucket_bytes=8192, shadow_layout=shadow_layout)
    pub = WeightPublisher(redis_url, queue, root=shm_root, sender=sender)
    try:
        for fill in (1.0, 2.0, 3.0):
            rec = await pub.publish_weights(ckpt(fill, "cuda:0"), transport="nccl")
            assert rec.transport == "nccl", rec
            await until(lambda: consumer.version == rec.version, 60, f"version {rec.version}")
            assert follower.history[-1].load["swap"] == "shadow"
            check(engine, fill)
            rcv = engine.workers[0].rollq_state.receiver
            assert rcv.status.in_place == (fill > 1.0), rcv.status
            assert rec.timings["layout_mode"] == float(shadow_layout and fill > 1.0)
    finally:
        await follower.stop()
        await pub.close()


@pytest.mark.parametrize("shadow_layout", [False, True])
async def test_nccl_versions_swapped_in_part_by_part_while_they_arrive(redis_url, queue, shm_root, shadow_layout):
    """WeightSyncSettings(swap_overlap=True): each part's parameters are exchanged on the engine's
    stream right after the part's CUDA event, then kept once the version is committed."""
    import asyncio

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    engine = FakeWorkerEngine(Fused, device="cuda:1")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, broadcast=True, swap_overlap=True,
                              overlap_lead_s=5.0))
    await follower.start()
    run = asyncio.create_task(consumer.run())  # its control channel brings the offers' hints
    sender = BroadcastSender(1, backend="nccl", timeout=60, device="cuda:0", group_bytes=2 * 64 * 32 * 2,
                             bucket_bytes=8192, shadow_layout=shadow_layout)
    pub = WeightPublisher(redis_url, queue, root=shm_root, sender=sender)
    try:
        swaps = []
        for fill in (1.0, 2.0, 3.0, 4.0):
            rec = await pub.publish_weights(ckpt(fill, "cuda:0"), transport="nccl")
            assert rec.transport == "nccl", rec
            await until(lambda: consumer.version == rec.version, 60, f"version {rec.version}")
            swaps.append(follower.history[-1].load["swap"])
            check(engine, fill)
        assert swaps == ["shadow", "shadow", "overlap", "overlap"], swaps
        assert follower.history[-1].load["parts"] >= 2 and follower.history[-1].load["kernel"] == "triton"
    finally:
        consumer.stop()
        await asyncio.wait_for(run, 30)
        await follower.stop()
        await pub.close()


def test_swap_kernel_swaps_every_width_and_odd_lengths():
    from rollq.weightsync.worker._swap_kernel import swap_bytes_

    for dtype, n in ((torch.bfloat16, 4096 * 3 + 1), (torch.float32, 1000), (torch.uint8, 4097), (torch.int64, 7)):
        a = torch.arange(n, device="cuda:0").to(dtype)
        b = (torch.arange(n, device="cuda:0") * 3 + 1).to(dtype)
        a0, b0 = a.clone(), b.clone()
        assert swap_bytes_(a, b), "Triton is part of the GPU stack here"
        assert torch.equal(a, b0) and torch.equal(b, a0)
    # fewer programs than blocks: each loops over its share (grid-stride)
    a = torch.arange(4096 * 10 + 3, device="cuda:0", dtype=torch.int32)
    b = -a
    swap_bytes_(a, b, programs=3)
    assert torch.equal(b, torch.arange(4096 * 10 + 3, device="cuda:0", dtype=torch.int32)) and torch.equal(a, -b)
    # odd byte offsets fall back to narrower elements, still swapping exactly
    buf = torch.arange(64, device="cuda:0", dtype=torch.uint8)
    x, y = buf[1:22].clone(), buf[33:54].clone()
    swap_bytes_(buf[1:22], buf[33:54])
    assert torch.equal(buf[1:22], y) and torch.equal(buf[33:54], x)


@pytest.mark.parametrize("chunk", [0, 4096])
async def test_ipc_versions_are_copied_device_to_device_into_the_shadow(redis_url, queue, shm_root, chunk, monkeypatch):
    """A trainer process on the same GPU exposes its CUDA tensors (CUDA IPC handles, zero-copy);
    the worker copies the first version into new tensors and traces the shadow's load plan,
    later ones straight into the shadow's bytes, in one burst or waiting for the device every
    ``chunk`` bytes. The trainer steps in place, so the worker opens its handles once and
    copies later versions through the mappings it kept. A trainer killed before the worker
    opens its handles leaves the served version, and the next trainer's version goes through.
    In one burst the copies run on a high-priority stream (``ipc_high_priority``)."""
    from rollq.weightsync.versions import read_load_errors
    from tests.weightsync.ipc_trainer_proc import trainer

    priorities: list[int] = []
    stream = torch.cuda.Stream

    def spy(*args, priority: int = 0, **kwargs):
        priorities.append(priority)
        return stream(*args, priority=priority, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", spy)
    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, ipc_chunk_bytes=chunk,
                                                           ipc_high_priority=chunk == 0))
    await follower.start()
    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--inplace") as t:
            for fill in (1, 2, 3):
                rec = await t.publish(fill)
                assert rec["timings"]["ipc_copied_bytes"] == 0  # CUDA tensors: zero-copy
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
                load = follower.history[-1].load
                assert load["swap"] == "shadow" and load["ipc"] is True, load
                assert bool(load.get("in_place")) == (fill > 1), load
                if fill == 1:
                    n = load["opened"]
                assert n > 0 and (load["opened"], load["reused"]) == ((n, 0) if fill == 1 else (0, n)), load
                assert load["open_s"] >= 0 and load["verify_s"] > 0, load
                assert all(w.rollq_state.ipc.chunk_bytes == chunk for w in engine.workers)
                assert (-1 in priorities) == (chunk == 0), priorities  # the copy's stream (the shadow's load uses others)
                check(engine, float(fill))
            async with follower._lock:  # no update starts before the trainer is gone
                rec = await t.publish(4)
                await t.kill()
        await until(lambda: read_load_errors(follower._client, consumer.keys), 60, "a load error")
        err = (await read_load_errors(follower._client, consumer.keys))[consumer.id]
        assert (err.version, err.error) == (rec["version"], "IpcUnavailable"), err
        check(engine, 3.0)
        assert all(len(w.rollq_state.ipc.maps) == 0 for w in engine.workers)  # the failure unmapped them
        async with trainer(redis_url, queue, "-", "--cuda") as t2:
            rec = await t2.publish(5)
            await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
            assert (follower.history[-1].load["opened"], follower.history[-1].load["reused"]) == (n, 0)
            check(engine, 5.0)
    finally:
        await follower.stop()


async def test_workers_watching_for_versions_copy_cuda_tensors_while_the_follower_cannot_start(redis_url, queue, shm_root):
    """``ipc_prestage`` on a GPU: each worker's watcher thread opens the trainer process's CUDA
    handles and copies the version device to device when it is announced, while the follower's
    lock keeps it from starting the update; the follower then only swaps it in. The first
    version traces the shadow's load plan in that thread, later ones go straight into it."""
    from rollq.weightsync.wire import State
    from tests.weightsync.ipc_trainer_proc import trainer

    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, ipc_prestage=True))
    staging = engine.workers[0].rollq_state.ipc
    await follower.start()
    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--inplace") as t:
            for fill in (1, 2, 3):
                async with follower._lock:  # only the workers' watchers can copy this version
                    rec = await t.publish(fill)
                    await until(lambda: staging.status.version == rec["version"] and staging.status.state is State.STAGED,
                                60, f"the watcher's copy of version {rec['version']}")
                    assert consumer.version != rec["version"]
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
                load = follower.history[-1].load
                assert load.get("prestaged") is True and load["swap"] == "shadow", load
                assert bool(load.get("in_place")) == (fill > 1), load
                check(engine, float(fill))
        assert staging.prestaged == 3
    finally:
        await follower.stop()


async def test_a_cuda_lease_is_released_once_the_replica_copied_it_and_the_next_step_does_not_reach_it(
        redis_url, queue, shm_root):
    """``WeightPublisher(ipc_lease=True)`` on a GPU: the trainer's CUDA tensors exposed
    zero-copy and without checksums; ``release_weights`` returns once the worker copied them
    device to device (into the shadow's bytes from the second version on), and the trainer's
    step right after does not reach the replica, which serves the published values."""
    import asyncio

    from rollq.replicas import live_replicas
    from tests.weightsync.ipc_trainer_proc import trainer

    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--lease", "--inplace") as t:
            await until(lambda: live_replicas(follower._client, consumer.keys), 30, "the replica in the registry")
            for fill in (1, 2):
                rec = await t.publish(fill)
                assert rec["timings"]["checksum_s"] == 0.0 and rec["timings"]["ipc_copied_bytes"] == 0.0, rec["timings"]
                assert (await t.release_copied(60)).get(consumer.id, 0) >= rec["version"]
                await t.bump(100.0)
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
                load = follower.history[-1].load
                assert load["ipc"] is True and bool(load.get("in_place")) == (fill > 1), load
                check(engine, float(fill))
    finally:
        consumer.stop()
        await task
        await follower.stop()


async def test_a_cuda_direct_swap_copies_the_leased_tensors_into_the_live_weights_by_the_load_plan(
        redis_url, queue, shm_root):
    """``ipc_direct`` on a GPU: the replica builds no shadow weights; the first leased version
    loads through load_weights at its swap (tracing the plan on the live weights); from the
    second on the worker only opens the trainer's CUDA tensors while serving, the swap copies
    them device to device into the live weights' bytes by the plan, and the release returns
    once it did: the trainer's step right after does not reach the replica. A version that is
    not leased then loads into shadow weights built for it, starting from live."""
    import asyncio

    from rollq.replicas import live_replicas
    from tests.weightsync.ipc_trainer_proc import trainer

    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, ipc_direct=True))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--lease", "--inplace") as t:
            await until(lambda: live_replicas(follower._client, consumer.keys), 30, "the replica in the registry")
            for fill in (1, 2, 3):
                rec = await t.publish(fill)
                assert (await t.release_copied(60)).get(consumer.id, 0) >= rec["version"]
                await t.bump(100.0)
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
                load = follower.history[-1].load
                assert (load["swap"], load["copied_by"]) == ("direct", "load_weights" if fill == 1 else "plan"), load
                # by the plan the swap call only enqueues the copies; the claim ended after their event
                assert load.get("pending", False) is (fill != 1) and (fill == 1 or load["wait_copy_s"] >= 0), load
                check(engine, float(fill))
            assert all(w.rollq_state.shadow is None for w in engine.workers)
        async with trainer(redis_url, queue, "-", "--cuda", "--inplace") as t:  # not leased: through the shadow
            rec = await t.publish(4)
            await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
            assert follower.history[-1].load["swap"] == "shadow"
            check(engine, 4.0)
    finally:
        consumer.stop()
        await task
        await follower.stop()


async def test_a_trainer_killed_while_a_direct_swaps_copies_run_on_the_device_leaves_the_version_whole(
        redis_url, queue, shm_root, monkeypatch):
    """A direct swap's copies queue on the engine's stream behind a long kernel (the swap call
    has returned), and the trainer process is killed before they run: its CUDA memory is then
    undefined, so the copies are torn (``SwapTimes.torn``) and the version is not taken from
    them; the replica loads the publisher's memmap copy of it instead and serves it whole,
    and its device still works."""
    import asyncio
    import threading

    import rollq.weightsync.worker._ipc as ipc_worker
    from tests.weightsync.ipc_trainer_proc import trainer

    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3, ipc_direct=True,
                                                           load_retries=0))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    enqueued = threading.Event()
    real_copy = ipc_worker.copy_by_plan

    def behind_a_long_kernel(dsts, srcs, device):
        torch.cuda._sleep(int(3e9))  # ~2 s of the engine's stream before the copies
        enqueued.set()
        return real_copy(dsts, srcs, device)

    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--lease", "--inplace", "--root", shm_root) as t:
            for fill in (1, 2):
                rec = await t.publish(fill)
                await t.release_copied(60)
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
            monkeypatch.setattr(ipc_worker, "copy_by_plan", behind_a_long_kernel)
            rec = await t.publish(3)
            assert await asyncio.to_thread(enqueued.wait, 60), "the direct swap's copies were not enqueued"
            await t.kill()
        await until(lambda: consumer.version == rec["version"], 60, "the version, from its memmap copy")
        assert follower.history[-1].load.get("swap") != "direct", follower.history[-1].load
        assert engine.workers[0].rollq_state.last_swap.torn, engine.workers[0].rollq_state.last_swap
        check(engine, 3.0)
        torch.cuda.synchronize()  # no fault left on the device
    finally:
        consumer.stop()
        await task
        await follower.stop()


async def test_a_cuda_snapshot_lets_the_trainer_step_right_after_publishing(redis_url, queue, shm_root):
    """``WeightPublisher(ipc_snapshot=True)`` on a GPU: the version is exposed as copies on the
    trainer's GPU (the extra memory is reported), so the trainer's next step, in place before
    the replica copied anything, does not reach the replica, which serves the published values.
    The copy is the publisher's own: no checksum is taken or verified, and the next version is
    copied into it, whose storages the worker kept mapped."""
    from tests.weightsync.ipc_trainer_proc import trainer

    engine = FakeWorkerEngine(Fused, device="cuda:0")
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=shm_root, reconcile_interval=0.3))
    await follower.start()
    try:
        async with trainer(redis_url, queue, "-", "--cuda", "--snapshot") as t:
            for fill in (1, 2):  # the second goes straight into the shadow's bytes
                async with follower._lock:  # the replica copies only after the trainer's step
                    rec = await t.publish(fill)
                    await t.bump(100.0)
                nbytes = sum(v.numel() * v.element_size() for v in ckpt(0.0, "cuda:0").values())
                assert rec["timings"]["ipc_copied_bytes"] == nbytes, rec["timings"]  # one copy, on the GPU
                # the publisher's own copy: no checksum; the second version rewrites the first's
                assert rec["timings"]["checksum_s"] == 0.0 and rec["timings"]["ipc_snapshot_reused"] == float(fill > 1)
                await until(lambda: consumer.version == rec["version"], 60, f"version {rec['version']}")
                load = follower.history[-1].load
                assert load["ipc"] is True and (load["opened"] == 0) == (fill > 1), load
                check(engine, float(fill))
    finally:
        await follower.stop()


