"""``stream: true`` of ``rollq serve``'s routes: chunks of a job's tokens while it runs.

A streamed request's job is submitted with ``stream=True``; its replica publishes each
sample's new tokens (:mod:`rollq.consumer._progress`) and :meth:`JobHandle.stream` reads
them here. Each piece becomes a chunk in vLLM's shape for the route (completions:
``choices[].text``; chat: ``delta.content``, after a first chunk with the role; the generate
route: ``token_ids``, and ``text`` in text mode). When the result is in, a last chunk per
choice carries the rest (what no piece had shown: a flush still buffered, entries trimmed, a
resume's continuation), the ``finish_reason`` and rollq's extension fields, and the usage
follows, as before. Pieces are a preview; the result is the record.

Redelivery: a job whose replica died runs again from scratch as a new attempt. A
:class:`Choice` checks every attempt's tokens (and the final ones) against what it has sent:
if they start with it, only the rest is sent; if not (sampling took another path), the stream
ends with vLLM's error chunk rather than text that the result contradicts.

>>> c = Choice()
>>> from rollq.protocol import ProgressEntry, pack_i32
>>> c.piece(ProgressEntry(delivery=1, sample=0, offset=0, tokens=pack_i32([1, 2]), text="ab"), None)
([1, 2], [], 'ab')
>>> c.rest([1, 2, 3], [], "abc")
([3], [], 'c')
>>> c.rest([1, 9, 3], [], "abc")
Traceback (most recent call last):
...
rollq.serve.streaming.Diverged: the job was run again after its tokens were streamed, and its result differs from them
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from ..protocol import ProgressEntry, Result
from . import generate as gen
from .responses import cancel_all, summed

if TYPE_CHECKING:
    from .schemas import ChatRequest, CompletionRequest


class _Server(Protocol):
    """What the chunks are made with: the app's response builders (``rollq.serve.app``)."""

    model_name: str
    tokenizer: Any

    def _text(self, sample: Any) -> str: ...
    def _token_str(self, tid: int, as_id: bool | None = False) -> str: ...
    def _ext(self, res: Result, sample: Any) -> dict[str, Any]: ...
    def _usage(self, res: Result, prompt_len: int) -> dict[str, int | None]: ...
    def _completion_logprobs(self, sample: Any, as_ids: bool | None) -> dict[str, Any]: ...
    def _completion_choice(self, req: Any, res: Result, i: int, s: Any, prompt_ids: list[int]) -> dict[str, Any]: ...
    def _chat_logprobs(self, sample: Any, as_ids: bool | None) -> dict[str, Any]: ...
    def _generate_choice(self, req: Any, res: Result, i: int, s: Any) -> dict[str, Any]: ...
    async def _streamed(self, handle: Any, session: str | None) -> Result: ...


#: A decoder of token ids to text (the served tokenizer's), or None.
Decode = Callable[[list[int]], str] | None


class Diverged(Exception):
    """A new attempt's tokens, or the result's, do not start with what was streamed."""

    def __init__(self) -> None:
        super().__init__("the job was run again after its tokens were streamed, and its result differs from them")


class Choice:
    """What one choice has streamed (token ids, text), and the attempt its pieces come from."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self._attempt: tuple[int, int] | None = None
        self._ids: list[int] = []  # the current attempt's tokens so far
        self._lps: list[float] = []
        self._text = ""
        self._lost = False  # a piece of the current attempt was missed: wait for the result

    def piece(self, p: ProgressEntry, decode: Decode) -> tuple[list[int], list[float], str] | None:
        """The new token ids, logprobs and text that piece ``p`` shows, or None (nothing new)."""
        if p.attempt != self._attempt:
            self._attempt, self._ids, self._lps, self._text, self._lost = p.attempt, [], [], "", False
        if self._lost or p.offset != len(self._ids) or (p.text is None and self._text):
            self._lost = True
            return None
        self._ids += p.token_ids
        self._lps += p.token_logprobs or []
        if p.text is not None:
            self._text += p.text
            text = self._text
        elif decode is not None:
            # Decoded here: the last token waits (with the next one it may decode otherwise,
            # as may a character's first bytes).
            text = decode(self._ids[:-1]).rstrip("\ufffd")
        else:
            text = ""
        n = len(self.ids)
        if self._ids[:n] != self.ids[: len(self._ids)]:  # the tokens decide; text follows them
            raise Diverged
        if len(self._ids) <= n:
            return None  # a new attempt catching up with what was sent
        delta = ""
        if text.startswith(self.text):  # else: not decoded as far yet
            delta, self.text = text[len(self.text) :], text
        new = (self._ids[n:], self._lps[n:], delta)
        self.ids = list(self._ids)
        return new

    def rest(self, ids: list[int], lps: list[float], text: str) -> tuple[list[int], list[float], str]:
        """What the final ``ids``, ``lps`` and ``text`` add to what was streamed."""
        n = len(self.ids)
        if ids[:n] != self.ids:
            raise Diverged
        if not text.startswith(self.text):  # the same tokens, decoded otherwise in pieces: the rest
            return ids[n:], lps[n:], text[len(os.path.commonprefix([text, self.text])) :]
        return ids[n:], lps[n:], text[len(self.text) :]


def _decoder(srv: _Server) -> Decode:
    tok = srv.tokenizer
    return None if tok is None else (lambda ids: tok.decode(ids, skip_special_tokens=True))


def _error(message: str, err_type: str = "StreamError") -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": 500}}


async def _pieces(
    handle: Any, choices: dict[int, Choice], decode: Decode
) -> AsyncIterator[tuple[int, list[int], list[float], str]]:
    """``(sample, new ids, new logprobs, new text)`` of each piece of ``handle``'s job that
    shows something new (raises :class:`Diverged`)."""
    async for p in handle.stream():
        c = choices.get(p.sample)
        if c is None:
            c = choices[p.sample] = Choice()
        new = c.piece(p, decode)
        if new is not None:
            yield (p.sample, *new)


def _rest(choices: dict[int, Choice], j: int, s: Any, srv: _Server) -> tuple[list[int], list[float], str]:
    c = choices.get(j) or Choice()
    return c.rest(s.token_ids, s.token_logprobs or [], srv._text(s))


async def completion_stream(
    srv: _Server, req: CompletionRequest, handles: list[Any], rid: str, prompts: list[dict[str, Any]], session: str | None = None
) -> AsyncIterator[dict[str, Any]]:
    """``/v1/completions``: the jobs of a batch one after the other, prompt-major indices."""
    created, index, usages, decode = int(time.time()), 0, [], _decoder(srv)
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name}
    for handle, prompt in zip(handles, prompts):
        choices: dict[int, Choice] = {}
        prompt_ids = prompt.get("prompt_token_ids")
        try:
            async for j, ids, lps, text in _pieces(handle, choices, decode):
                yield {
                    **head,
                    "usage": None,
                    "choices": [
                        {
                            "index": index + j,
                            "text": text,
                            "finish_reason": None,
                            "stop_reason": None,
                            "prompt_logprobs": None,
                            "prompt_token_ids": prompt_ids if req.return_token_ids and len(choices[j].ids) == len(ids) else None,
                            "logprobs": srv._completion_logprobs(
                                SimpleNamespace(token_ids=ids, token_logprobs=lps), req.return_tokens_as_token_ids
                            )
                            if req.logprobs is not None
                            else None,
                            "token_ids": ids if req.return_token_ids else None,
                        }
                    ],
                }
            res = await srv._streamed(handle, session)
            if res.error is not None:
                await cancel_all(handles)  # the rest of the batch
                yield _error(res.error.message, res.error.type)
                return
            prompt_ids = prompt_ids or res.prompt_token_ids or []
            for j, s in enumerate(res.samples):
                ids, lps, text = _rest(choices, j, s, srv)
                choice = srv._completion_choice(req, res, index + j, s, prompt_ids)
                choice["text"] = text
                if req.return_token_ids:
                    choice["token_ids"] = ids
                if req.logprobs is not None:
                    choice["logprobs"] = srv._completion_logprobs(
                        SimpleNamespace(token_ids=ids, token_logprobs=lps), req.return_tokens_as_token_ids
                    )
                yield {**head, "choices": [choice], "usage": None}
        except Diverged as e:
            await cancel_all(handles)
            yield _error(str(e))
            return
        index += len(res.samples)
        usages.append(srv._usage(res, len(prompt_ids) or res.prompt_tokens))
    yield {**head, "choices": [], "usage": summed(usages)}


async def chat_stream(
    srv: _Server, req: ChatRequest, handle: Any, rid: str, prompt: dict[str, Any], session: str | None = None
) -> AsyncIterator[dict[str, Any]]:
    """``/v1/chat/completions``: a role chunk per choice, content deltas, the last chunks."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": srv.model_name}
    for i in range(req.n):
        yield {
            **head,
            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        }
    choices: dict[int, Choice] = {}
    want = req.logprobs or req.return_token_ids
    try:
        async for j, ids, lps, text in _pieces(handle, choices, _decoder(srv)):
            if text or want:
                yield {
                    **head,
                    "choices": [
                        {
                            "index": j,
                            "delta": {"content": text},
                            "finish_reason": None,
                            "logprobs": srv._chat_logprobs(
                                SimpleNamespace(token_ids=ids, token_logprobs=lps), req.return_tokens_as_token_ids
                            )
                            if req.logprobs
                            else None,
                            "token_ids": ids if req.return_token_ids else None,
                        }
                    ],
                }
        res = await srv._streamed(handle, session)
        if res.error is not None:
            yield _error(res.error.message, res.error.type)
            return
        prompt_ids = prompt.get("prompt_token_ids") or res.prompt_token_ids or []
        for i, s in enumerate(res.samples):
            ids, lps, text = _rest(choices, i, s, srv)
            rest = SimpleNamespace(token_ids=ids, token_logprobs=lps)
            choice = {
                "index": i,
                "delta": {"content": text},
                "logprobs": srv._chat_logprobs(rest, req.return_tokens_as_token_ids) if req.logprobs else None,
                "finish_reason": s.finish_reason,
                "stop_reason": None,
                "token_ids": ids if req.return_token_ids else None,
                "rollq": srv._ext(res, s),
            }
            yield {**head, "choices": [choice], "prompt_token_ids": prompt_ids if req.return_token_ids and i == 0 else None}
    except Diverged as e:
        await cancel_all([handle])
        yield _error(str(e))
        return
    yield {**head, "choices": [], "usage": srv._usage(res, len(prompt_ids) or res.prompt_tokens)}


def _generate_logprobs(srv: _Server, req: gen.GenerateRequest, ids: list[int], lps: list[float]) -> Any:
    if req.sampling_params.logprobs is None:
        return None
    return gen.text_logprobs(ids, lps, srv._token_str) if req.output_mode == "text" else gen.tokens_logprobs(ids, lps)


async def generate_stream(
    srv: _Server, req: gen.GenerateRequest, handle: Any, rid: str, session: str | None = None
) -> AsyncIterator[dict[str, Any]]:
    """``/inference/v1/generate``: a chunk per piece (``token_ids``; ``text`` in text mode),
    then one per choice with the rest, its ``finish_reason`` and ``weight_versions``, then
    the usage chunk when ``stream_options.include_usage``, as vLLM's stream ends."""
    opts = req.stream_options or gen.StreamOptions()
    n_prompt = len(req.token_ids)
    first = True
    choices: dict[int, Choice] = {}

    def chunk(choice: dict[str, Any], generated: int) -> dict[str, Any]:
        nonlocal first
        out: dict[str, Any] = {"request_id": rid, "usage": None}
        if req.return_token_ids and first:
            out["prompt_token_ids"] = req.token_ids
        first = False
        if opts.continuous_usage_stats:
            out["usage"] = gen.usage(n_prompt, generated)
        return {**out, "output_mode": req.output_mode, "choices": [choice]}

    try:
        async for j, ids, lps, text in _pieces(handle, choices, _decoder(srv)):
            choice: dict[str, Any] = {
                "index": j,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": ids,
                "logprobs": _generate_logprobs(srv, req, ids, lps),
            }
            if req.output_mode == "text":
                choice["text"] = text
            yield chunk(choice, len(choices[j].ids))
        res = await srv._streamed(handle, session)
        if res.error is not None:
            yield _error(res.error.message, res.error.type)
            return
        for i, s in enumerate(res.samples):
            ids, lps, text = _rest(choices, i, s, srv)
            choice = srv._generate_choice(req, res, i, s)
            choice["token_ids"], choice["logprobs"] = ids, _generate_logprobs(srv, req, ids, lps)
            if req.output_mode == "text":
                choice["text"] = text
            yield chunk(choice, len(s.token_ids))
    except Diverged as e:
        await cancel_all([handle])
        yield _error(str(e))
        return
    if opts.include_usage:
        total = gen.usage(n_prompt, sum(len(s.token_ids) for s in res.samples))
        yield {
            "request_id": rid,
            "usage": {k: v for k, v in total.items() if v is not None},
            "output_mode": req.output_mode,
            "choices": [],
        }
