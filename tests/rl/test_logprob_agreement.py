"""Weight sync, end to end: after an update the replica's behavior logprobs equal the
trainer's at that version (memmap and gloo broadcast); a mis-loaded version (stale
``lm_head``) breaks the equality by orders of magnitude."""

from __future__ import annotations

import pytest
import pytest_asyncio

from rollq import Producer
from rollq.weightsync import WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from tests.helpers import until
from tests.helpers.agreement import AGREEMENT_MAX, AGREEMENT_MEAN, agreement, perturbed, trainer_model
from tests.vllm_fixtures import serving_replica

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PROMPTS = [[5, 17, 99, 3, 250, 7], [300] * 8, [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
SAMPLING = {"max_tokens": 24, "n": 4, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "detokenize": False}


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return trainer_model(tiny_model_path)


@pytest_asyncio.fixture(loop_scope="session")
async def replica(vllm_engine, redis_url, queue, tmp_path):
    root = str(tmp_path / "w")
    async with serving_replica(vllm_engine, redis_url, queue, root, broadcast=True) as (consumer, _):
        yield consumer, root


async def _serving(consumer, version: int) -> None:
    await until(lambda: consumer.version >= version, 60, f"the replica to serve version {version}")


async def _agreement(p: Producer, model, state, version: int) -> tuple[float, float, int]:
    return await agreement(p, model, state, version, PROMPTS, SAMPLING)


async def test_replica_logprobs_match_the_trainer_after_memmap_and_gloo_updates(replica, model, redis_url, queue):
    consumer, root = replica
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=60, bucket_bytes=1 << 20)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    try:
        async with Producer(redis_url, queue) as p:
            v1 = perturbed(base, 1)
            rec = await pub.publish_weights(v1, transport="memmap")
            await _serving(consumer, rec.version)
            mean, worst, n = await _agreement(p, model, v1, rec.version)
            assert n == 3 * 4 * 24 and mean <= AGREEMENT_MEAN and worst <= AGREEMENT_MAX, (mean, worst)

            v2 = perturbed(base, 2)
            rec = await pub.publish_weights(v2, transport="nccl")  # the gloo broadcast
            assert rec.transport == "nccl", rec.timings
            await _serving(consumer, rec.version)
            mean, worst, n = await _agreement(p, model, v2, rec.version)
            assert n == 3 * 4 * 24 and mean <= AGREEMENT_MEAN and worst <= AGREEMENT_MAX, (mean, worst)

            # Mis-loaded: the replica gets v3 with v2's lm_head, the trainer holds all of v3.
            v3 = perturbed(base, 3)
            rec = await pub.publish_weights(dict(v3, **{"lm_head.weight": v2["lm_head.weight"]}), transport="memmap")
            await _serving(consumer, rec.version)
            mean, worst, _ = await _agreement(p, model, v3, rec.version)
            assert mean > 100 * AGREEMENT_MEAN and worst > AGREEMENT_MAX, (mean, worst)

            rec = await pub.publish_weights(base, transport="memmap")  # leave the shared engine as found
            await _serving(consumer, rec.version)
            mean, worst, _ = await _agreement(p, model, None, rec.version)
            assert mean <= AGREEMENT_MEAN
    finally:
        await pub.close()
