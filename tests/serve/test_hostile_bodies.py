"""Hostile bodies for ``rollq serve``'s generation routes: each of 2,400 requests (every
route, one to three fields of a valid body replaced by values of the wrong type, size or
sign, in sampling_params too) gets an answer below 500, and a JSON body when not streamed."""

from __future__ import annotations

import json
import random

import pytest

from tests.serve.conftest import ECHO_MODEL


VALS = [None, True, False, 0, -1, 1, 2**31, 2**63, -2**63, 1e308, -1e-300, float("inf"), "", "x", "\u0000", [], [[]], [1], [[1, 2]], ["a"], {}, {"a": 1}, [None], [-5], [2**40], 0.5, "nan", [{"role": "user", "content": "hi"}], [{"role": "user"}], [{"role": 5, "content": []}], [{"role": "user", "content": [{"type": "text", "text": "x"}]}], [{"role": "user", "content": [{"type": "image_url"}]}]]
FIELDS = {
  "/v1/completions": ["model", "prompt", "max_tokens", "n", "logprobs", "temperature", "top_p", "top_k", "stop", "stream", "stream_options", "return_token_ids", "user", "seed", "echo", "best_of", "min_tokens", "logit_bias", "presence_penalty", "prompt_logprobs", "suffix", "stop_token_ids", "ignore_eos", "min_p", "repetition_penalty", "return_tokens_as_token_ids", "max_completion_tokens"],
  "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "temperature", "stream", "stream_options", "user", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "response_format", "seed", "stop", "return_token_ids", "echo"],
  "/inference/v1/generate": ["token_ids", "sampling_params", "stream", "model", "request_id", "features", "cache_salt", "priority"],
}
SP = ["max_tokens", "n", "temperature", "logprobs", "top_p", "top_k", "stop", "seed", "min_tokens", "ignore_eos", "detokenize", "stop_token_ids"]

@pytest.mark.parametrize("seed", range(6))
async def test_hostile_bodies_get_an_answer_below_500(client, seed):
    rng = random.Random(seed)
    bad = []
    for i in range(400):
        path = rng.choice(list(FIELDS))
        base = {"/v1/completions": {"model": ECHO_MODEL, "prompt": [1, 2], "max_tokens": 2},
                "/v1/chat/completions": {"model": ECHO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                "/inference/v1/generate": {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}}[path]
        body = dict(base)
        for _ in range(rng.randint(1, 3)):
            f = rng.choice(FIELDS[path])
            body[f] = rng.choice(VALS)
        if path == "/inference/v1/generate" and rng.random() < 0.6:
            sp = dict(body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {})
            for _ in range(rng.randint(1, 3)):
                sp[rng.choice(SP)] = rng.choice(VALS)
            body["sampling_params"] = sp
        try:
            raw = json.dumps(body, allow_nan=True)
        except Exception:
            continue
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        if r.status_code >= 500:
            bad.append((path, raw, r.status_code, r.text[:300]))
        elif r.status_code == 200 and body.get("stream") is not True:
            try:
                r.json()
            except Exception:
                bad.append((path, raw, "notjson", r.text[:200]))
    assert not bad, "\n".join(map(str, bad[:15]))
