"""``rollq serve`` over the echo engine: response shapes, error bodies, auth, disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollq.consumer.engine import EchoEngine
from tests.helpers import until
from tests.serve.conftest import ECHO_MODEL as MODEL
from tests.serve.conftest import http_server

async def test_health_and_models(client):
    assert (await client.get("/health")).status_code == 200
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


async def test_completion_of_token_prompt(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "n": 2,
                                                   "logprobs": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # EchoEngine: sample j repeats the prompt shifted by j.
    assert body["choices"][0]["token_ids"] == [5, 6, 7]
    assert body["choices"][1]["token_ids"] == [6, 7, 8]
    assert body["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9, "prompt_tokens_details": None}
    ext = body["choices"][0]["rollq"]
    assert ext["version_start"] == ext["version_end"] == 0 and ext["token_versions"] == [0, 0, 0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_of_prompts_is_one_job_each_and_its_choices_come_prompt_major(client, stream):
    """TRL's client sends every prompt of a step in one request; vLLM's server answers with the
    n choices of prompt i at indices i*n .. i*n+n-1, and so does rollq serve."""
    body = {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "n": 2, "return_token_ids": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stream": stream}
    if stream:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = [ln async for ln in r.aiter_lines() if ln]
        events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
        choices, usage = [c for e in events for c in e["choices"]], events[-1]["usage"]
    else:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices, usage = r.json()["choices"], r.json()["usage"]
    got = {c["index"]: (c["prompt_token_ids"], joined(choices, c["index"], "token_ids")) for c in choices}
    assert got == {0: ([5, 6], [5, 6]), 1: ([5, 6], [6, 7]), 2: ([7, 8, 9], [7, 8]), 3: ([7, 8, 9], [8, 9])}
    last = [c for c in choices if c["finish_reason"] is not None]  # the last chunk of each choice (all of it unstreamed)
    assert [c["index"] for c in last] == [0, 1, 2, 3]
    assert {c["rollq"]["job_id"] for c in last[:2]} != {c["rollq"]["job_id"] for c in last[2:]}
    assert sum((c["logprobs"]["tokens"] for c in choices if c["index"] == 2), []) == ["token_id:7", "token_id:8"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 8)


@pytest.mark.parametrize("prompt, needle", [(["a", [1, 2]], "strings only or token-id lists only"),
                                            ([[1], []], "non-empty")])
async def test_a_bad_batch_is_refused_whole(client, prompt, needle):
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_batch_is_bounded():
    import msgspec

    from rollq.errors import InvalidJob
    from rollq.serve.schemas import MAX_BATCH_PROMPTS, CompletionRequest, completion_prompts

    req = msgspec.convert({"prompt": [[1]] * (MAX_BATCH_PROMPTS + 1)}, CompletionRequest)
    with pytest.raises(InvalidJob, match=f"more than {MAX_BATCH_PROMPTS}"):
        completion_prompts(req)


async def test_completion_without_return_token_ids_omits_them(client):
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["logprobs"] is None


async def test_chat_returns_token_ids(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "return_token_ids": True, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["token_ids"]) == 2
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5, -0.5]


#: vLLM's error types: a body that does not validate is FastAPI's "Bad Request"; a bad value
#: found after (the sampling params, the prompt) is "BadRequestError".
_INVALID, _BAD = "Bad Request", "BadRequestError"


@pytest.mark.parametrize("body, status, err_type, needle", [
    (b"{not json", 400, _INVALID, "malformed JSON"),
    (b'{"prompt": 3}', 400, _INVALID, "prompt"),
    (b'{"prompt": "hi", "n": "two"}', 400, _INVALID, "n"),
    (b'{"max_tokens": 2}', 400, _INVALID, "prompt"),
    (b'[1, 2]', 400, _INVALID, "object"),
    (b'{"prompt": "hi", "temperature": -1}', 400, _BAD, "temperature"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, _BAD, "max_tokens"),
    (b'{"prompt": ""}', 400, _BAD, "prompt"),
    (b'{"prompt": "hi", "model": "other"}', 404, "NotFoundError", "does not exist"),
    (b'{"prompt": "hi", "logprobs": 5}', 400, _BAD, "logprobs"),
])
async def test_bad_requests_get_vllm_error_bodies(client, body, status, err_type, needle):
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == err_type
    assert needle in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
async def test_a_body_not_sent_as_json_is_refused_as_vllm_does(client, path):
    r = await client.post(path, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == _INVALID and "application/json" in r.json()["error"]["message"]


async def test_unknown_fields_are_ignored_as_vllm_does(client):
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "no_such_field": 1})
    assert r.status_code == 200, r.text


async def test_oversized_body_is_413(client):
    r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


@pytest.mark.parametrize("headers", [{"Authorization": ""}, {"Authorization": "Bearer wrong"}])
async def test_api_key(client, headers):
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert (await client.get("/v1/models", headers=headers)).status_code == 401
    assert (await client.get("/health", headers=headers)).status_code == 200


def joined(choices: list[dict], index: int, field: str) -> list:
    """A streamed choice's ``field`` over its chunks (each chunk holds what is new)."""
    return sum((c[field] for c in choices if c["index"] == index), [])


async def test_streamed_completion(client):
    async with client.stream("POST", "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "n": 2, "stream": True,
                                                              "return_token_ids": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    choices = [c for e in events for c in e["choices"]]
    assert {c["index"]: joined(choices, c["index"], "token_ids") for c in choices} == {0: [3, 4], 1: [4, 5]}
    assert events[-1]["usage"]["completion_tokens"] == 4


async def _running(engine):
    return engine.stats().running


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_job(make_producer, make_consumer, queue, stream):
    engine = EchoEngine(delay_per_token=0.1)  # 300 tokens: 30 s unless cancelled
    make_consumer.start(make_consumer(queue, engine=engine))
    producer = await make_producer(queue)
    async with http_server(producer, model_name=MODEL) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            req = c.build_request("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": stream})
            resp = asyncio.ensure_future(c.send(req, stream=True))
            await until(lambda: engine.stats().running == 1, 10, "the job to run")
            if stream:
                r = await resp
                it = r.aiter_lines()
                assert (await it.__anext__()).startswith("data: ")  # the role chunk
                await r.aclose()
            else:
                resp.cancel()
        await until(lambda: engine.stats().running == 0, 5, "the job to be cancelled")
        assert producer.outstanding == 0


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "user", "content": "hi", "token_ids": [1]}], "only an assistant message"),
    ([{"role": "assistant", "content": "hi", "token_ids": [1, -1]}], "negative"),
    ([{"role": "assistant", "content": "hi", "token_ids": [1]}], "--tokenizer"),  # this app has none
])
async def test_message_token_ids_refused_where_they_cannot_be_kept(client, messages, needle):
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


async def test_oversized_body_without_a_length_is_413_over_http(echo):
    """A chunked body (no content-length) is cut off at the bound while it streams in."""
    producer, _ = echo

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(1000):  # up to 1 MB: far past the bound
            yield b"x" * 1024
        yield b'"}'

    async with http_server(producer, model_name=MODEL, max_body_bytes=4096) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            r = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == 413
            ok = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})  # the server serves on
            assert ok.status_code == 200
    assert producer.outstanding == 0


async def test_a_batch_goes_out_in_one_submission_and_a_bad_prompt_sends_none(client, echo, redis_client, queue, monkeypatch):
    """Every job of a batch is validated first and sent in one round of submit calls (no round
    trip per prompt); a prompt the queue refuses sends no job of the batch."""
    producer, _ = echo

    async def one_by_one(*a, **kw):
        raise AssertionError("a batch's prompts were submitted one job at a time")

    monkeypatch.setattr(producer, "submit", one_by_one)
    r = await client.post("/v1/completions", json={"prompt": [[5, 6], [7], [8, 9]], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    from rollq.keys import QueueKeys

    stream = QueueKeys(queue).jobs
    before = await redis_client.xlen(stream)
    r = await client.post("/v1/completions", json={"prompt": [[5, 6], [-3]], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert await redis_client.xlen(stream) == before  # the good first prompt was not sent either


@pytest.mark.parametrize("session", [False, True])
async def test_redis_out_of_reach_is_a_503_with_a_vllm_error_body(fresh_redis, queue, session):
    """A request while Redis is down gets vLLM's error body with 503 and a message naming
    Redis, within about ``command_timeout``; the server serves again once Redis is back."""
    from rollq import Producer
    from rollq.settings import RedisSettings

    p = Producer(RedisSettings.from_url(fresh_redis.url, command_timeout=1.0, connect_timeout=0.5), queue)
    try:
        async with http_server(p, model_name=MODEL) as base:
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                fresh_redis.stop()
                headers = {"X-Session-ID": "s1"} if session else {}
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2},
                                 headers=headers)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["type"] == "ServiceUnavailableError" and err["code"] == 503 and "Redis" in err["message"], err
                fresh_redis.start()
                assert (await c.get("/health")).status_code == 200
    finally:
        await p.close()
