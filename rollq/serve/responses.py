"""Response plumbing of ``rollq serve``'s OpenAI routes: a failed job's error body, a batch's
summed usage, server-sent events, and cancelling the jobs of a request given up.

>>> summed([{"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3},
...         {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": None}])
{'prompt_tokens': 3, 'total_tokens': 7, 'completion_tokens': 3, 'prompt_tokens_details': None}
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Iterable

import anyio
import msgspec
from starlette.responses import Response, StreamingResponse

from ..protocol import Result
from .errors import error_response

#: Job errors that are the request's fault: vLLM's server answers these with 400.
_CLIENT_ERRORS = frozenset({"InvalidJob", "PromptTooLong", "JobRejected"})


def job_error(res: Result) -> Response:
    err = res.error
    if err is None:
        return error_response("the job failed without an error", 500)
    return error_response(f"{err.type}: {err.message}", 400 if err.type in _CLIENT_ERRORS else 500)


def summed(usages: list[dict[str, int | None]]) -> dict[str, int | None]:
    """The usage of a batch: its prompts' usages added up."""
    keys = ("prompt_tokens", "total_tokens", "completion_tokens")
    return {**{k: sum(u[k] or 0 for u in usages) for k in keys}, "prompt_tokens_details": None}


async def cancel_all(handles: Iterable[Any]) -> None:
    """Cancel the jobs of ``handles`` not done (a batch given up), even from a cancelled task."""
    with anyio.CancelScope(shield=True):
        for h in handles:
            if not h.done():
                with contextlib.suppress(Exception):
                    await h.cancel()


def sse(events: AsyncIterator[dict[str, Any]], handles: Any) -> StreamingResponse:
    """Server-sent events of ``events``, then ``data: [DONE]``; the jobs of ``handles`` (one
    handle or a list) are cancelled when the stream stops early (the client went away)."""
    jobs = handles if isinstance(handles, list) else [handles]

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for ev in events:
                yield b"data: " + msgspec.json.encode(ev) + b"\n\n"
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                await cancel_all(jobs)

    return StreamingResponse(body(), media_type="text/event-stream")
