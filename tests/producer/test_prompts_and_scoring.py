"""Prompt forms a trainer sends (``TokensPrompt`` dicts, bare token lists), the prompt ids of
text prompts in results, and scoring jobs (vLLM's ``prompt_logprobs``), through real vLLM."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import pytest_asyncio
import torch

from rollq import Consumer, ConsumerSettings, InvalidJob, Producer
from rollq.keys import QueueKeys
from rollq.protocol import decode_job, make_job, prompt_parts, score_spec
from tests.helpers import bounded


# -- what a prompt may be ------------------------------------------------------------------
@pytest.mark.parametrize("prompt, want", [
    ({"prompt_token_ids": [5, 6, 7]}, (None, [5, 6, 7])),
    ([5, 6, 7], (None, [5, 6, 7])),
    ((5, 6), (None, [5, 6])),
    ({"prompt": "hi"}, ("hi", None)),
    ("hi", ("hi", None)),
])
def test_prompt_forms_vllm_accepts(prompt, want):
    assert prompt_parts(prompt) == want
    job = make_job(id="j", reply="p", prompt=prompt)
    assert (job.text, job.prompt_token_ids) == want


@pytest.mark.parametrize("prompt, says", [
    (3.5, "got float"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, "unsupported key"),
    ({"prompt_token_ids": "abc"}, "sequence of token ids"),
    ([1, "a"], "got a str"),
    ([1, True], "got a bool"),
    ({}, "exactly one of"),
    (object(), "TokensPrompt"),
])
def test_other_prompt_types_are_refused_saying_what_is_expected(prompt, says):
    with pytest.raises(InvalidJob, match=says):
        make_job(id="j", reply="p", prompt=prompt)


def test_prompt_and_prompt_token_ids_together_are_refused():
    with pytest.raises(InvalidJob, match="exactly one"):
        make_job(id="j", reply="p", prompt=[1, 2], prompt_token_ids=[3])


async def test_submit_takes_a_tokens_prompt_and_refuses_bad_types(redis_url, queue):
    async with Producer(redis_url, queue) as p:
        h = await p.submit({"prompt_token_ids": [1, 2, 3]}, sampling={"max_tokens": 2})
        assert h.id
        with pytest.raises(InvalidJob, match="prompt must be"):
            await p.submit(12345)
        with pytest.raises(InvalidJob, match="prompt_logprobs must be"):
            await p.submit([1, 2], sampling={"prompt_logprobs": 99})


# -- every argument is checked before anything is enqueued ---------------------------------
async def _nothing_queued(redis_client, queue) -> bool:
    k = QueueKeys(queue)
    return await redis_client.xlen(k.jobs) == 0 and await redis_client.hget(k.stats, "submitted") is None


@pytest.mark.parametrize("kw, says", [
    ({"prompt_token_ids": [9, 9]}, "sets its own prompt_token_ids"),
    ({"prompt": "hi"}, "sets its own prompt"),
    ({"sampling": {"max_tokens": 2}}, "sets its own sampling"),
    ({"timeout": "5"}, "timeout"),
    ({"nonsense": 1}, "unknown job field"),
])
async def test_score_refuses_what_would_override_or_break_it_before_enqueueing(
        kw, says, make_producer, queue, redis_client):
    """Used to: prompt_token_ids= silently replaced the context, sampling= silently made the
    result hold no logprobs ([] returned), and a bad timeout raised after the job ran."""
    p = await make_producer(queue)
    with pytest.raises(InvalidJob, match=says):
        await bounded(p.score([1, 2], [3], **kw), 10, "score() to refuse")  # no replica: never answered
    assert await _nothing_queued(redis_client, queue)


async def test_score_reads_an_iterator_of_token_ids_once(make_producer, make_consumer, queue):
    """Used to: ``len(context)`` raised TypeError after the job had been enqueued and run."""
    c = make_consumer(queue)
    make_consumer.start(c)
    p = await make_producer(queue)
    assert (await bounded(p.score(iter([1, 2]), iter([3, 4])), 20, "the score")).logprobs == [-0.5, -0.5]  # EchoEngine's logprobs
    await make_consumer.stop(c)


@pytest.mark.parametrize("ids", [
    np.array([1.7, 2.0]), np.array([np.nan, 1.0]), np.array([1, 2], dtype=np.float32),
    np.array([2**31, 1], dtype=np.uint32), torch.tensor([1.0, 2.0]), torch.tensor([1.0], dtype=torch.bfloat16),
])
async def test_token_arrays_that_are_not_integers_are_refused(ids, make_producer, queue, redis_client):
    """Used to: cast silently (1.7 became 1, NaN -2147483648, 2**31 wrapped to -2**31)."""
    p = await make_producer(queue)
    with pytest.raises(InvalidJob, match="token ids must|must hold token ids"):
        await p.submit(prompt_token_ids=ids)
    with pytest.raises(InvalidJob, match="token ids must|must hold token ids"):
        await p.submit({"prompt_token_ids": ids})
    with pytest.raises(InvalidJob, match="token ids must|must hold token ids"):
        await p.submit_many([{"prompt_token_ids": [5]}, {"prompt_token_ids": ids}])
    with pytest.raises(InvalidJob, match="token ids must|must hold token ids"):
        await bounded(p.score(ids, [3]), 10, "score() to refuse")
    k = QueueKeys(queue)
    assert await redis_client.xlen(k.jobs) <= 1  # at most the valid job of submit_many, nothing else
    for _, fields in await redis_client.xrange(k.jobs):
        assert decode_job(fields[b"d"]).prompt_token_ids == [5]


# -- through real vLLM ---------------------------------------------------------------------
pytest_vllm = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session")
async def replica(vllm_engine, redis_url, queue):  # noqa: F811
    c = Consumer(vllm_engine, redis_url, queue, settings=ConsumerSettings(heartbeat_interval=0.2))
    task = asyncio.create_task(c.run())
    yield c
    c.stop()
    await asyncio.wait_for(task, 30)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_scoring_job_returns_the_logprobs_generation_sampled(replica, redis_url, queue):
    context = [11, 42, 7, 300, 5]
    async with Producer(redis_url, queue) as p:
        gen = await (await p.submit(prompt_token_ids=context, sampling={"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 0})).result(timeout=60)
        cont, behavior = gen.samples[0].token_ids, gen.samples[0].token_logprobs
        scored = await p.score(context, cont, timeout=60)
        assert scored.version == gen.version_start == 0 and len(scored.logprobs) == len(cont)
        assert max(abs(a - b) for a, b in zip(scored.logprobs, behavior)) < 1e-4
        # The version is the replica's when it scored (here: the same weights, called 3).
        replica.set_version(3)
        again = await p.score(context, cont, timeout=60, min_version=3)
        assert again.version == 3 and max(abs(a - b) for a, b in zip(again.logprobs, scored.logprobs)) < 1e-6
        # The batch form: the whole prompt's logprobs, the first token without one.
        r = await (await p.submit(**score_spec(context, cont))).result(timeout=60)
        lps = r.prompt_logprobs
        assert lps[0] is None and len(lps) == len(context) + len(cont)
        assert all(x is not None and x <= 0 and math.isfinite(x) for x in lps[1:])
        assert r.prompt_token_ids is None  # a token prompt: the submitter has the ids
        # Text prompts come back with the ids the replica tokenized.
        t = await (await p.submit("hello world", sampling={"max_tokens": 2})).result(timeout=60)
        assert t.prompt_token_ids == list(replica.engine.tokenizer.encode("hello world"))


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_generate_takes_tokens_prompts_and_returns_prompt_ids_and_logprobs(replica, redis_url, queue):
    from rollq.producer.generate import RollqLLM

    def run() -> tuple:
        with RollqLLM(redis_url, queue) as llm:
            sp = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 0, "logprobs": 0}
            many = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [8, 9, 10], "some text"], sp)
            one = llm.generate([8, 9, 10], sp)  # a bare list of ints is one token prompt
            with pytest.raises(InvalidJob, match="prompt must be"):
                llm.generate([3.5], sp)
            return many, one

    many, one = await asyncio.to_thread(run)
    assert [o.prompt_token_ids[:3] for o in many[:2]] == [[5, 6, 7], [8, 9, 10]]
    assert many[2].prompt_token_ids and many[2].prompt == "some text"
    assert not isinstance(one, list) and one.prompt_token_ids == [8, 9, 10]
    assert one.outputs[0].token_ids == many[1].outputs[0].token_ids  # greedy: the same prompt
    for o in many + [one]:
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
        assert o.outputs[0].token_versions == [o.policy_version[0]] * len(o.outputs[0].token_ids)
