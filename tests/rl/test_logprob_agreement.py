"""Weight sync, end to end: after an update the replica's behavior logprobs equal the
trainer's at that version (memmap and gloo broadcast); a mis-loaded version (stale
``lm_head``) breaks the equality by orders of magnitude. At temperature 0.7 the trainer
refuses vLLM's raw logprobs and agrees with its processed ones."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import pytest_asyncio
import torch

from rollq import Consumer, ConsumerSettings, Producer
from rollq.rl import GrpoTrainer, SamplingTransformError, logprob_agreement, token_logprobs
from rollq.weightsync import WeightPublisher
from rollq.weightsync.nccl import BroadcastSender
from tests.helpers import until
from tests.helpers.agreement import MISLOADED_MEAN, agreement, agreement_bounds, generate, perturbed, trainer_model
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
    bound = agreement_bounds(consumer.engine)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sender = BroadcastSender(num_workers=1, backend="gloo", timeout=60, bucket_bytes=1 << 20)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    try:
        async with Producer(redis_url, queue) as p:
            v1 = perturbed(base, 1)
            rec = await pub.publish_weights(v1, transport="memmap")
            await _serving(consumer, rec.version)
            mean, worst, n = await _agreement(p, model, v1, rec.version)
            print(f"memmap: {n} tokens, mean |diff| {mean:.2e}, max {worst:.2e}")
            assert n == 3 * 4 * 24 and mean <= bound.mean and worst <= bound.max, (mean, worst)

            v2 = perturbed(base, 2)
            rec = await pub.publish_weights(v2, transport="nccl")  # the gloo broadcast
            assert rec.transport == "gloo", rec.timings
            await _serving(consumer, rec.version)
            mean, worst, n = await _agreement(p, model, v2, rec.version)
            print(f"gloo: {n} tokens, mean |diff| {mean:.2e}, max {worst:.2e}")
            assert n == 3 * 4 * 24 and mean <= bound.mean and worst <= bound.max, (mean, worst)

            # Mis-loaded: the replica gets v3 with v2's lm_head, the trainer holds all of v3.
            v3 = perturbed(base, 3)
            rec = await pub.publish_weights(dict(v3, **{"lm_head.weight": v2["lm_head.weight"]}), transport="memmap")
            await _serving(consumer, rec.version)
            mean, worst, _ = await _agreement(p, model, v3, rec.version)
            print(f"mis-loaded lm_head: mean |diff| {mean:.2e}, max {worst:.2e}")
            assert mean > MISLOADED_MEAN and worst > bound.max, (mean, worst)

            rec = await pub.publish_weights(base, transport="memmap")
            await _serving(consumer, rec.version)
            mean, worst, _ = await _agreement(p, model, None, rec.version)
            assert mean <= bound.mean
    finally:
        # Leave the shared engine serving the checkpoint, also when a check above failed (the
        # later tests of the session generate at whatever it serves).
        if consumer.version and (rec := await pub.publish_weights(base, transport="memmap")):
            await _serving(consumer, rec.version)
        await pub.close()


# -- sampling transforms: temperature 0.7 ----------------------------------------------------
HOT = dict(SAMPLING, temperature=0.7)


@contextlib.asynccontextmanager
async def _plain_consumer(engine, redis_url, queue):
    """A plain consumer of ``queue`` on ``engine`` (no weight follower: version 0, the
    checkpoint's weights, as the engines of this session hold between tests)."""
    c = Consumer(engine, redis_url, queue, settings=ConsumerSettings(lease_ttl=5))
    task = asyncio.create_task(c.run())
    try:
        yield c
    finally:
        c.stop()
        await asyncio.wait_for(task, 30)


def _rows(results):
    prompts = [pr for pr, r in zip(PROMPTS, results) for _ in r.samples]
    return prompts, [s.token_ids for r in results for s in r.samples], [s.token_logprobs for r in results for s in r.samples]


async def test_raw_logprobs_at_temperature_07_are_refused_by_the_trainer(vllm_engine, model, redis_url, queue, tiny_model_path):
    async with _plain_consumer(vllm_engine, redis_url, queue), Producer(redis_url, queue) as p:
        results = await generate(p, 0, PROMPTS, HOT)
    src = results[0].logprob_source
    assert (src.kind, src.temperature) == ("raw", 0.7) and all(r.logprob_source == src for r in results)
    with pytest.raises(SamplingTransformError, match=r"^temperature=0\.7: job .* holds vLLM's raw logprobs"):
        logprob_agreement(model, results, PROMPTS)
    trainer = GrpoTrainer(trainer_model(tiny_model_path))
    with pytest.raises(SamplingTransformError, match=r"^temperature=0\.7: "):
        trainer.step(list(zip(PROMPTS, results)), [[0.0, 1.0, 0.0, 1.0]] * 3)
    assert trainer.version == 0
    # Why: they are the logprobs of temperature 1 (the weights are the checkpoint's), not those
    # of the distribution the tokens were drawn from.
    prompts, comps, behaviour = _rows(results)
    with torch.no_grad():
        at_1, mask = token_logprobs(model, prompts, comps)
        at_07, _ = token_logprobs(model, prompts, comps, temperature=0.7)
    b = torch.tensor(behaviour)
    d1, d07 = float((at_1 - b).abs()[mask].mean()), float((at_07 - b).abs()[mask].mean())
    print(f"raw logprobs at T=0.7: mean |diff| {d1:.2e} from the trainer's T=1, {d07:.2e} from its T=0.7")
    assert d1 <= agreement_bounds(vllm_engine).mean and d07 > 1e-2


async def test_processed_logprobs_at_temperature_07_agree_with_the_trainer(vllm_engine_processed, model, redis_url, queue, tiny_model_path):
    engine = vllm_engine_processed
    async with _plain_consumer(engine, redis_url, queue), Producer(redis_url, queue) as p:
        results = await generate(p, 0, PROMPTS, HOT)
    assert all(r.logprob_source.kind == "processed" and r.logprob_source.transformed() == ["temperature=0.7"] for r in results)
    bound = agreement_bounds(engine)
    mean, worst, n = logprob_agreement(model, results, PROMPTS)
    print(f"processed logprobs at T=0.7: {n} tokens, mean |diff| {mean:.2e}, max {worst:.2e}")
    assert n == 3 * 4 * 24 and mean <= bound.mean and worst <= bound.max, (mean, worst)
    # The trainer's loss takes the same distribution: its ratio is 1 on these samples.
    trainer = GrpoTrainer(trainer_model(tiny_model_path))
    st = trainer.step(list(zip(PROMPTS, results)), [[0.0, 1.0, 0.0, 1.0]] * 3)
    assert st.diff_tokens == n and st.diff_sum / n <= bound.mean and st.diff_max <= bound.max, st
    # The control: the temperature-1 logprobs of the same tokens are far off.
    prompts, comps, behaviour = _rows(results)
    with torch.no_grad():
        at_1, mask = token_logprobs(model, prompts, comps)
    d1 = float((at_1 - torch.tensor(behaviour)).abs()[mask].mean())
    print(f"the same tokens at the trainer's T=1: mean |diff| {d1:.2e}")
    assert d1 > 1e-2
