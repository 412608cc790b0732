"""``POST /inference/v1/generate`` over the echo engine: vLLM's token-in/token-out bodies (each
response is validated by vLLM's own pydantic models where vLLM is installed), the rollq
versions in vLLM's ``weight_versions`` and the ``rollq`` field, and vLLM's 400s."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import ECHO_MODEL

ROUTE = "/inference/v1/generate"


def vllm_protocol():
    return pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")


def assert_vllm_shape(model, body):
    """``body`` validates as vLLM's ``model`` and has the same top-level and choice fields
    (the choices add the ``rollq`` field)."""
    parsed = model.model_validate(body)
    assert set(body) == set(type(parsed).model_fields)
    choice_fields = set(type(parsed).model_fields["choices"].annotation.__args__[0].model_fields)
    for c in body["choices"]:
        assert set(c) == choice_fields | {"rollq"}
    return parsed


async def test_generate_tokens(client):
    r = await client.post(ROUTE, json={"model": ECHO_MODEL, "token_ids": [5, 6, 7], "return_token_ids": True,
                                       "sampling_params": {"max_tokens": 3, "n": 2, "logprobs": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_vllm_shape(vllm_protocol().GenerateTokensResponse, body)
    assert body["request_id"].startswith("generate-tokens-") and body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == [5, 6, 7] and body["model"] == ECHO_MODEL
    # EchoEngine: sample j repeats the prompt shifted by j.
    assert [c["token_ids"] for c in body["choices"]] == [[5, 6, 7], [6, 7, 8]]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    c0 = body["choices"][0]
    assert c0["finish_reason"] == "length"
    assert c0["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]
    assert c0["rollq"]["token_versions"] == [0, 0, 0] and c0["rollq"]["version_start"] == 0
    assert [e["token_id"] for e in c0["logprobs"]["content"]] == [5, 6, 7]
    assert [e["logprob"] for e in c0["logprobs"]["content"]] == [-0.5] * 3
    assert c0["logprobs"]["content"][0]["top_logprobs"] == [{"token_id": 5, "logprob": -0.5, "rank": None}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == 9


async def test_generate_defaults_omit_what_was_not_asked(client):
    r = await client.post(ROUTE, json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
                          headers={"X-Request-Id": "abc"})
    body = r.json()
    assert body["request_id"] == "generate-tokens-abc"  # vLLM takes the header's id
    assert body["prompt_token_ids"] is None and body["choices"][0]["logprobs"] is None
    assert body["prompt_logprobs"] is None


async def test_generate_text_mode_and_prompt_logprobs(client):
    r = await client.post(ROUTE, json={"token_ids": [104, 105], "output_mode": "text", "request_id": "q",
                                       "sampling_params": {"max_tokens": 2, "logprobs": 1, "prompt_logprobs": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_vllm_shape(vllm_protocol().GenerateTextResponse, body)
    assert body["request_id"] == "generate-tokens-q" and body["output_mode"] == "text"
    c0 = body["choices"][0]
    assert isinstance(c0["text"], str)
    assert [e["token"] for e in c0["logprobs"]["content"]] == ["token_id:104", "token_id:105"]
    assert body["prompt_logprobs"] == [None, {"105": {"logprob": -0.5, "rank": None, "decoded_token": None}}]


async def test_generate_stream(client):
    proto = vllm_protocol()
    async with client.stream("POST", ROUTE, json={
            "token_ids": [3, 4], "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 2, "n": 2, "logprobs": 0}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    for e in events:
        proto.GenerateTokensStreamResponse.model_validate(e)
    assert events[0]["prompt_token_ids"] == [3, 4] and "prompt_token_ids" not in events[1]
    choices = [c for e in events for c in e["choices"]]
    assert {i: sum((c["token_ids"] for c in choices if c["index"] == i), []) for i in (0, 1)} == {0: [3, 4], 1: [4, 5]}
    last = [c for c in choices if c["finish_reason"] is not None]  # each choice's last chunk covers the whole output
    assert [c["index"] for c in last] == [0, 1]
    assert all(c["weight_versions"] == [{"version": "0", "start": 0, "end": 2}] for c in last)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {"prompt_tokens": 2, "total_tokens": 6,
                                                                   "completion_tokens": 4}


async def test_generate_stream_without_usage_ends_with_the_choices(client):
    async with client.stream("POST", ROUTE, json={"token_ids": [3], "stream": True,
                                                  "sampling_params": {"max_tokens": 1}}) as r:
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):])["choices"][0] for ln in lines[:-1]]
    assert chunks[-1]["finish_reason"] == "length" and sum((c["token_ids"] for c in chunks), []) == [3]


_INVALID, _BAD = "Bad Request", "BadRequestError"


@pytest.mark.parametrize("body, err_type, needle", [
    ({"sampling_params": {}}, _INVALID, "token_ids"),
    ({"token_ids": [1]}, _INVALID, "sampling_params"),
    ({"token_ids": "1 2", "sampling_params": {}}, _INVALID, "token_ids"),
    ({"token_ids": [1, 2.5], "sampling_params": {}}, _INVALID, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "many"}}, _INVALID, "max_tokens"),
    ({"token_ids": [1], "sampling_params": [1]}, _INVALID, "sampling_params"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "bytes"}, _INVALID, "output_mode"),
    ({"token_ids": [], "sampling_params": {}}, _BAD, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, _BAD, "negative"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, _BAD, "temperature"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, _BAD, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"n": 0}}, _BAD, "n"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 5}}, _BAD, "logprobs"),
    ({"token_ids": [1], "sampling_params": {"logit_bias": {"1": 5.0}}}, _BAD, "logit_bias"),
    ({"token_ids": [1], "sampling_params": {"structured_outputs": {"json": {}}}}, _BAD, "structured_outputs"),
    ({"token_ids": [1], "sampling_params": {}, "priority": 3}, _BAD, "Priority"),
    ({"token_ids": [1], "sampling_params": {}, "kv_transfer_params": {}}, _BAD, "kv_transfer_params"),
    ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, _BAD, "detokenize"),
])
async def test_generate_bad_requests_are_400_as_vllm(client, body, err_type, needle):
    r = await client.post(ROUTE, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["type"] == err_type and needle in err["message"]


async def test_generate_unknown_fields_are_ignored_and_other_models_404(client):
    ok = await client.post(ROUTE, json={"token_ids": [1], "sampling_params": {"max_tokens": 1, "future": 1},
                                        "no_such_field": True})
    assert ok.status_code == 200, ok.text
    r = await client.post(ROUTE, json={"token_ids": [1], "sampling_params": {}, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = await client.post(ROUTE, json={"token_ids": [1], "sampling_params": {}}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
