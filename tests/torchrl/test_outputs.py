"""rollq results as vLLM output objects and in TorchRL's LLM layout (no engine needed), and
the engine's control hint to replicas (echo engine, real Redis)."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("torchrl")
pytest.importorskip("vllm")
import torch  # noqa: E402

from rollq import Consumer, ConsumerSettings  # noqa: E402
from rollq.consumer.engine import EchoEngine  # noqa: E402
from rollq.errors import InvalidJob  # noqa: E402
from rollq.protocol import Result, Sample, pack_f32, pack_i32  # noqa: E402
from rollq.torchrl import AsyncVLLM, request_output, results_to_llm_tensordict  # noqa: E402
from tests.helpers import FAST, until  # noqa: E402


def _result(**kw):
    base = dict(
        id="j1", version_start=3, version_end=4, replica="r0",
        prompt_ids=pack_i32([10, 11, 12]), prompt_lps=pack_f32([math.nan, -1.5, -2.5]),
        samples=[
            Sample(tokens=pack_i32([5, 6, 7]), logprobs=pack_f32([-0.5, -0.25, -1.0]), text="abc",
                   finish_reason="length", versions=[(3, 0), (4, 2)]),
            Sample(tokens=pack_i32([8]), logprobs=pack_f32([-2.0]), text="d", finish_reason="stop"),
        ],
    )
    base.update(kw)
    return Result(**base)


def test_request_output_is_vllms_with_per_position_logprobs_and_version_spans():
    from vllm.outputs import RequestOutput

    out = request_output(_result(), "hi", None)
    assert isinstance(out, RequestOutput)
    assert out.prompt_token_ids == [10, 11, 12] and out.policy_version == (3, 4) and out.replica == "r0"
    assert out.prompt_logprobs[0] is None
    assert [(t, d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], [11, 12])] == [(11, -1.5), (12, -2.5)]
    a, b = out.outputs
    assert a.token_ids == [5, 6, 7] and [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)] == [-0.5, -0.25, -1.0]
    assert a.cumulative_logprob == pytest.approx(-1.75)
    assert [(s.version, s.start, s.end) for s in a.weight_versions] == [("3", 0, 2), ("4", 2, 3)]
    assert [(s.version, s.start, s.end) for s in b.weight_versions] == [("3", 0, 1)]
    assert out.rollq_result.id == "j1"


def test_a_token_prompt_keeps_the_callers_ids():
    out = request_output(_result(prompt_ids=None, prompt_lps=None), None, [1, 2])
    assert out.prompt_token_ids == [1, 2] and out.prompt_logprobs is None


def test_llm_layout_has_torchrls_keys_one_row_per_sample():
    td = results_to_llm_tensordict([_result()])
    assert td.batch_size == torch.Size([2])
    full = td.get(("tokens", "full"), as_list=True)
    assert [f.tolist() for f in full] == [[10, 11, 12, 5, 6, 7], [10, 11, 12, 8]]
    assert td.get(("tokens", "response"), as_list=True)[1].tolist() == [8]
    full_lp = td.get(("log_probs", "full"), as_list=True)[0].tolist()
    assert math.isnan(full_lp[0]) and full_lp[1:] == [-1.5, -2.5, -0.5, -0.25, -1.0]  # no score: NaN, TorchRL's pad
    assert td.get(("masks", "all_assistant_mask"), as_list=True)[0].tolist() == [False] * 3 + [True] * 3
    assert bool(td.get(("masks", "all_attention_mask"), as_list=True)[1].all())
    assert td.get("policy_version", as_list=True)[0].tolist() == [3, 3, 4]
    padded = td.get(("tokens", "full"), as_padded_tensor=True, padding_side="left", padding_value=-100)
    assert padded.tolist()[1] == [-100, -100, 10, 11, 12, 8]


def test_results_to_tensordict_gives_the_torchrl_layout_on_request():
    from rollq.producer.batch import results_to_tensordict

    td = results_to_tensordict([_result()], layout="torchrl")
    assert td.get(("tokens", "response"), as_list=True)[0].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="layout"):
        results_to_tensordict([_result()], layout="nope")


def test_llm_layout_needs_the_ids_of_token_prompts():
    r = _result(prompt_ids=None, prompt_lps=None)
    with pytest.raises(InvalidJob, match="prompts="):
        results_to_llm_tensordict([r])
    td = results_to_llm_tensordict([r], prompts=[[1, 2]])
    assert td.get(("tokens", "full"), as_list=True)[1].tolist() == [1, 2, 8]


class _CountingEcho(EchoEngine):
    resets = 0

    async def reset_prefix_cache(self) -> None:
        self.resets += 1


async def test_reset_prefix_cache_reaches_the_replicas(redis_url, queue):
    engine = _CountingEcho()
    c = Consumer(engine, redis_url, queue, settings=ConsumerSettings(**FAST))
    task = asyncio.create_task(c.run())
    llm = AsyncVLLM(redis_url, queue)
    try:
        await until(lambda: c.state == "serving", 10, "consumer serving")
        await until(lambda: bool(llm.replicas()), 10, "replica registered")
        assert llm.get_tp_size() == 1 and llm.num_replicas == 1
        # The hint is pub/sub: sent once the replica's control channel is subscribed.
        await until(lambda: llm.reset_prefix_cache() >= 1, 10, "the replica subscribed to its control channel")
        await until(lambda: engine.resets >= 1, 10, "the reset hint handled")
    finally:
        await asyncio.to_thread(llm.shutdown)
        c.stop()
        await asyncio.wait_for(task, 20)

