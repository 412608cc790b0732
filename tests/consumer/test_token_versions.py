"""Per-token policy versions: where each version began inside a sample when a ``keep``
weight update landed mid-generation (``Sample.versions``), through ``Result``,
``results_to_tensordict`` and ``RollqLLM.generate``; checked against a transformers
recomputation of the logprobs through real vLLM."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
import torch

from rollq import Consumer, ConsumerSettings, Producer
from rollq.consumer.engine import EchoEngine, SwapProgress
from rollq.producer.batch import results_to_tensordict
from rollq.protocol import UNKNOWN_START, Result, Sample, pack_i32
from rollq.protocol.prompts import Scores, score_spec
from rollq.weightsync import WeightPublisher
from tests.helpers import FAST, until
from tests.helpers.agreement import agreement_bounds, decode_vs_prefill_bounds, model_at, recompute
from tests.vllm_fixtures import checkpoint_state, serving_replica


# -- the record itself ---------------------------------------------------------------------
def test_token_versions_follow_the_starts_and_mark_unknown_spans():
    s = Sample(tokens=pack_i32(list(range(6))), versions=[(1, 0), (2, 2), (3, 4)])
    assert s.token_versions(1) == [1, 1, 2, 2, 3, 3]
    assert s.single_version(1) is None
    # A start that is not known: from the last known start on, either version could have
    # made the tokens; the later known start is exact again.
    s = Sample(tokens=pack_i32(list(range(6))), versions=[(1, 0), (2, 2), (3, UNKNOWN_START), (4, 5)])
    assert s.token_versions(1) == [1, 1, -1, -1, -1, 4]
    # A version that began after the last token made none of them.
    s = Sample(tokens=pack_i32([7, 8]), versions=[(5, 0), (6, 2)])
    assert s.token_versions(5) == [5, 5] and s.single_version(5) == 5
    assert Sample(tokens=pack_i32([7])).single_version(9) == 9


def test_tensordict_carries_a_per_token_version():
    r = Result(id="a", version_start=1, version_end=2, samples=[
        Sample(tokens=pack_i32([1, 2, 3, 4]), versions=[(1, 0), (2, 3)]),
        Sample(tokens=pack_i32([5, 6])),
    ])
    td = results_to_tensordict([r])
    assert td["policy_version"].tolist() == [[1, 1, 1, 2], [1, 1, -1, -1]]


# -- the consumer's side, echo engine (every token exists when a request starts) -----------
async def test_swap_while_running_records_boundaries(redis_url, queue):
    engine = EchoEngine(delay_per_token=0.01)
    c = Consumer(engine, redis_url, queue, settings=ConsumerSettings(**FAST))
    task = asyncio.create_task(c.run())
    try:
        async with Producer(redis_url, queue) as p:
            hs = await p.submit_many([{"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 50, "n": 2}}] * 3)
            await until(lambda: c.running_count() == 3, 10, "3 running jobs")
            c.set_version(1, engine.swap_progress(None))  # echo: all 50 tokens came before
            c.set_version(2, None)  # an engine that cannot tell: the start is unknown
            rs = await p.gather(hs, timeout=20)
        for r in rs:
            for s in r.samples:
                assert s.versions == [(0, 0), (1, 50), (2, UNKNOWN_START)]
            # Version 1 began after the last token, so version 2 (start unknown) did too:
            # the result claims neither.
            assert r.token_versions(1) == [0] * 50
            assert r.policy_version == (0, 0)
        # A job started after the swaps is all on the new version, with no marks.
        async with Producer(redis_url, queue) as p:
            r = await (await p.submit(prompt_token_ids=[4], sampling={"max_tokens": 3})).result(timeout=10)
        assert r.policy_version == (2, 2) and r.samples[0].versions is None
    finally:
        c.stop()
        await asyncio.wait_for(task, 10)


def test_missing_requests_count_as_not_started_only_when_the_report_is_complete():
    from rollq.consumer._in_hand import mark_versions

    samples = [Sample(tokens=pack_i32([1] * 8)), Sample(tokens=pack_i32([1] * 8))]
    mark_versions(samples, 3, [(4, {0: 5}, True), (5, {}, True), (6, {0: 7}, False)])
    assert samples[0].versions == [(3, 0), (4, 5), (5, 0), (6, 7)]
    assert samples[1].versions == [(3, 0), (4, 0), (5, 0), (6, UNKNOWN_START)]
    assert SwapProgress().complete is False


# -- real vLLM ---------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="session")
async def keep_replica(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    root = str(tmp_path / "w")
    async with serving_replica(vllm_engine, redis_url, queue, root) as (consumer, _):
        yield consumer, root


PROMPT = [9, 8, 7, 11, 42]


def two_versions(model_path):
    """The checkpoint's weights and weights far from them (every tensor moved by N(0, 0.3)):
    the first token after a boundary between them cannot pass for the old version's."""
    base = checkpoint_state(model_path)
    g = torch.Generator().manual_seed(7)
    return base, {k: v + torch.randn(v.shape, generator=g) * 0.3 for k, v in base.items()}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_keep_update_mid_generation_marks_the_first_token_of_the_new_version(keep_replica, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, root = keep_replica
    base, new = two_versions(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    prompt = PROMPT
    try:
        async with Producer(redis_url, queue) as p:
            await p.set_update_policy("keep")
            v1 = (await pub.publish_weights(base)).version
            await until(lambda: consumer.version == v1, 60, "version 1 served")
            made = consumer.engine.stats().generated_tokens
            h = await p.submit(prompt_token_ids=prompt, sampling={"max_tokens": 400, "ignore_eos": True, "n": 2, "logprobs": 0})
            await until(lambda: consumer.running_count() == 1, 30, "the job running")
            # some tokens of each sample on version 1 (the engine's step reports count them)
            await until(lambda: consumer.engine.stats().generated_tokens >= made + 2 * 16, 30, "tokens made on version 1")
            v2 = (await pub.publish_weights(new)).version
            r = await h.result(timeout=120)
            assert r.policy_version == (v1, v2)
            for s in r.samples:
                (va, start_a), (vb, b) = s.versions
                assert (va, start_a, vb) == (v1, 0, v2)
                assert 0 < b < 400, s.versions  # the update landed mid-generation
                toks, lps = s.token_ids, s.token_logprobs
                hf_old = recompute(model_at(tiny_model_path, base), prompt, toks[: b + 1])
                # Every token before the boundary was sampled on version 1 exactly ...
                assert max(abs(x - y) for x, y in zip(lps[:b], hf_old[:b])) < 1e-3
                # ... and the first one after it was not (the new weights differ by far).
                assert abs(lps[b] - hf_old[b]) > 1e-2
            td = results_to_tensordict([r])
            assert set(td["policy_version"][0].tolist()) == {v1, v2}
            await pub.publish_weights(base)  # leave the shared engine as found
    finally:
        await pub.close()


@pytest_asyncio.fixture(loop_scope="session")
async def resume_replica(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    root = str(tmp_path / "w")
    async with serving_replica(vllm_engine, redis_url, queue, root) as (consumer, follower):
        follower.settings = dataclasses.replace(follower.settings, abort_resume=True)
        yield consumer, root


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "n": 2}], ids=["greedy", "sampled-n2"])
async def test_abort_update_resumes_from_the_partial_tokens(resume_replica, redis_url, queue, tiny_model_path, sampling):  # noqa: F811
    """``abort`` with ``abort_resume`` mid-generation: each sample keeps its version-1 tokens
    (greedy: the old model's greedy choices; logprobs of the old weights) and continues on
    version 2 from them; its logprobs after the boundary are the new weights'."""
    consumer, root = resume_replica
    base, new = two_versions(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    prompt = PROMPT
    try:
        async with Producer(redis_url, queue) as p:
            await p.set_update_policy("abort")
            v1 = (await pub.publish_weights(base)).version
            await until(lambda: consumer.version == v1, 60, "version 1 served")
            made = consumer.engine.stats().generated_tokens
            h = await p.submit(prompt_token_ids=prompt, sampling={
                "max_tokens": 400, "ignore_eos": True, "logprobs": 0, **sampling})  # vLLM: greedy is n=1
            n = sampling.get("n", 1)
            await until(lambda: consumer.running_count() == 1, 30, "the job running")
            await until(lambda: consumer.engine.stats().generated_tokens >= made + n * 16, 30, "tokens made on version 1")
            # Frozen mid-generation until the update's abort ends it (the swap resumes the engine).
            await consumer.engine.pause("keep")
            v2 = (await pub.publish_weights(new)).version
            r = await h.result(timeout=120)
            # The replica's own version-2 logprobs of each whole sample, scored in one prefill.
            scored = [Scores.of(await (await p.submit(**score_spec(prompt, s.token_ids))).result(timeout=60),
                                len(prompt)) for s in r.samples]
            await pub.publish_weights(base)  # leave the shared engine as found
        assert r.ok and r.policy_version == (v1, v2) and r.deliveries == 1 and len(r.samples) == n
        old_model, new_model = model_at(tiny_model_path, base), model_at(tiny_model_path, new)
        bound = agreement_bounds(consumer.engine)
        for s, sc in zip(r.samples, scored):
            (va, start_a), (vb, b) = s.versions
            assert (va, start_a, vb) == (v1, 0, v2)
            assert 0 < b < 400, s.versions  # aborted mid-generation, resumed from its tokens
            toks, lps = s.token_ids, s.token_logprobs
            assert len(toks) == len(lps) == 400 and s.finish_reason == "length"
            # After the boundary the continuation's logprobs are the replica's own at version 2
            # over the whole context (old tokens re-read at the new version), as one prefill of
            # the finished sample gives them; the first token's is not version 1's.
            assert sc.version == v2
            gap = [abs(x - y) for x, y in zip(lps[b:], sc.logprobs[b:])]
            own = decode_vs_prefill_bounds(consumer.engine)
            assert sum(gap) / len(gap) <= own.mean and max(gap) <= own.max, (
                b, max(gap), gap.index(max(gap)), sum(gap) / len(gap))
            # Before the boundary: what version 1 generates (greedy: its argmax), with its logprobs.
            if sampling["temperature"] == 0.0:
                ids = torch.tensor([prompt + toks[:b]])
                with torch.no_grad():
                    greedy = old_model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
                assert toks[:b] == greedy
            hf_old = recompute(old_model, prompt, toks[:b])
            assert max(abs(x - y) for x, y in zip(lps[:b], hf_old)) < 1e-3
            # After it: version 2's logprobs over the whole sequence so far.
            # transformers' version 2 agrees as closely as the replica's kernels allow: on the CPU
            # to 1e-3; on a GPU no further from it than the replica's own prefill is.
            hf_new = recompute(new_model, prompt, toks)
            hf_gap = max(abs(x - y) for x, y in zip(lps[b:], hf_new[b:]))
            kernels = max(abs(x - y) for x, y in zip(sc.logprobs[b:], hf_new[b:]))
            tol = 1e-3 if consumer.engine.device == "cpu" else kernels + bound.max
            assert hf_gap <= tol, (hf_gap, kernels)
            assert abs(lps[b] - recompute(old_model, prompt, toks[: b + 1])[b]) > 1e-2
    finally:
        await pub.close()
