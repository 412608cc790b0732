"""The ASGI app: vLLM's OpenAI routes, each request one rollq job.

``create_app(producer, model_name=...)`` serves ``GET /health``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` and vLLM's token-in/token-out
``POST /inference/v1/generate`` (``stream: true``: server-sent events of the tokens as the
replica generates them, :mod:`rollq.serve.streaming`). With ``tokenizer`` the chat template is applied here, once, and the job carries the
token ids; without it the job carries the messages and the replica applies the template.
A client that goes away before its result cancels the job (and its vLLM request).

A request with a session key (the ``X-Session-ID`` header, else OpenAI's ``user`` field) goes
to the replica that served its session before, unless that replica is gone or overloaded
(:mod:`rollq.serve.sessions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..connection import connect
from ..errors import InvalidJob, SubmitInterrupted
from ..protocol import Result
from . import generate as gen
from . import streaming
from .dev_routes import DevRoutes
from .errors import VALIDATION_ERROR, error_response, queue_unreachable, unauthorized
from .pause import Gate
from .responses import cancel_all, job_error, sse, summed
from .schemas import ChatRequest, CompletionRequest, chat_messages, completion_prompts, exact_turns, sampling_of
from .sessions import Sessions
from .template import template_ids

if TYPE_CHECKING:  # torch: imported at startup where weight transfer is on
    from .weights import WeightReceiver, WeightTransferConfig

#: Bodies larger than this are refused with 413 (a chat of long token lists stays far below).
MAX_BODY_BYTES = 8 << 20
_DISCONNECT_POLL = 0.2


class _BodyTooLarge(Exception):
    pass


def _stream_field(req: Any) -> dict[str, Any]:
    """The job spec's ``stream`` field for a request: its replica publishes its tokens while
    they are generated when the request streams (:mod:`rollq.serve.streaming`)."""
    return {"stream": True} if req.stream else {}


class _Server:
    def __init__(self, producer: Any, model_name: str, tokenizer: Any, api_key: str | None, max_body_bytes: int):
        self.producer = producer
        #: Sticky sessions (set at startup when enabled, :mod:`rollq.serve.sessions`).
        self.sessions: Sessions | None = None
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        #: ``/pause`` and ``/resume`` (:mod:`rollq.serve.pause`).
        self.gate = Gate()
        #: A trainer's weight updates (``--weight-transfer``; :mod:`rollq.serve.weights`).
        self.receiver: WeightReceiver | None = None
        #: The server's Redis client (set at startup).
        self.redis: Any = None

    # -- request plumbing --------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        return request.headers.get("authorization", "") == f"Bearer {self.api_key}"

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _BodyTooLarge
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body_or_empty(self, request: Request) -> bytes | None:
        """The body of a development route (None: larger than the bound, or the client went away)."""
        try:
            return await self._body(request)
        except (_BodyTooLarge, ClientDisconnect):
            return None

    async def _decode(self, request: Request, typ: type) -> Any:
        """The decoded body, or the error response to send instead."""
        if not self._authorized(request):
            return unauthorized()
        if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
            return error_response("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                                  400, err_type=VALIDATION_ERROR)
        try:
            body = await self._body(request)
        except _BodyTooLarge:
            return error_response(f"request body exceeds {self.max_body_bytes} bytes", 413)
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            req: Any = msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as e:
            return error_response(f"invalid request: {e}", 400, err_type=VALIDATION_ERROR)
        except msgspec.DecodeError as e:
            return error_response(f"malformed JSON: {e}", 400, err_type=VALIDATION_ERROR)
        if req.model is not None and req.model != self.model_name:
            return error_response(f"The model `{req.model}` does not exist.", 404, "model")
        if isinstance(req, gen.GenerateRequest):
            return req
        if req.stream is False and req.n < 1:
            return error_response("n must be at least 1", 400, "n")
        return req

    async def _wait(self, request: Request, handle: Any) -> Result | None:
        """The job's result, or None after cancelling it because the client went away."""
        waiter = asyncio.ensure_future(handle.result(raise_error=False))
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=_DISCONNECT_POLL)
                if done:
                    return waiter.result()
                if await request.is_disconnected():
                    await handle.cancel()
                    return None
        finally:
            if not waiter.done():
                waiter.cancel()

    def _token_str(self, tid: int, as_id: bool | None = False) -> str:
        if self.tokenizer is None or as_id:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])

    def _text(self, sample: Any) -> str:
        if sample.text is not None:
            return sample.text
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @staticmethod
    def _ext(res: Result, sample: Any) -> dict[str, Any]:
        return {"version_start": res.version_start, "version_end": res.version_end,
                "token_versions": sample.token_versions(res.version_start), "replica": res.replica, "job_id": res.id}

    @staticmethod
    def _usage(res: Result, prompt_len: int) -> dict[str, int | None]:
        completion = sum(len(s.token_ids) for s in res.samples)
        return {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion, "completion_tokens": completion,
                "prompt_tokens_details": None}

    @staticmethod
    def _session(request: Request, req: Any) -> str | None:
        """The request's session key: ``X-Session-ID``, else the body's ``user``."""
        return request.headers.get("x-session-id") or getattr(req, "user", None) or None

    async def _submit(self, spec: dict[str, Any], session: str | None = None) -> Any:
        """Submit one job (:meth:`_submit_all`)."""
        return (await self._submit_all([spec], session))[0]

    async def _submit_all(self, specs: list[dict[str, Any]], session: str | None = None) -> list[Any]:
        """Submit the jobs of one request once the gate is open (``/pause``), in one round
        (``Producer.submit_batch``): every spec is validated first, so a bad one sends none.
        A session's jobs are targeted at its replica (see the module doc); after a trainer's
        weight update they need the version that update published, as vLLM serves every
        request after ``/finish_weight_update`` on the new weights."""
        await self.gate.wait_open()
        extra: dict[str, Any] = {}
        if session is not None and self.sessions is not None:
            replica = await self.sessions.pick(session)
            if replica is not None:
                extra["replica"] = replica
        if self.receiver is not None and self.receiver.version:
            extra["min_version"] = self.receiver.version
        handles = await self.producer.submit_batch([{**spec, **extra} for spec in specs])
        for handle in handles:
            self.gate.track(handle)
        return handles

    async def _served(self, session: str | None, res: Result) -> None:
        if session is not None and self.sessions is not None and res.error is None:
            await self.sessions.served(session, res.replica)

    async def _outcome(self, request: Request, handle: Any, session: str | None) -> Result | Response:
        """A non-streamed request's result (its session noted), or the response to send
        instead: 499 when the client went away, the job's error."""
        res = await self._wait(request, handle)
        if res is None:
            return Response(status_code=499)
        await self._served(session, res)
        return job_error(res) if res.error is not None else res

    async def _streamed(self, handle: Any, session: str | None) -> Result:
        """A streamed request's result, its session noted."""
        res: Result = await handle.result(raise_error=False)
        await self._served(session, res)
        return res

    # -- routes ------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return unauthorized()
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rollq",
                "root": self.model_name, "parent": None, "max_model_len": None, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        req = await self._decode(request, CompletionRequest)
        if isinstance(req, Response):
            return req
        handles: list[Any] = []
        try:
            if req.logprobs is not None and req.logprobs > 1:
                raise InvalidJob("logprobs above 1 are not served: a rollq result carries the sampled token's logprob")
            prompts = completion_prompts(req)
            sampling = sampling_of(req, req.max_tokens, req.logprobs is not None)
            session = self._session(request, req)
            # one job per prompt of a batch, sent in one round
            handles = await self._submit_all([{**prompt, "sampling": sampling, **_stream_field(req)} for prompt in prompts], session)
        except InvalidJob as e:
            await cancel_all(handles)
            return error_response(str(e), 400)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return sse(streaming.completion_stream(self, req, handles, rid, prompts, session), handles)
        results: list[Result] = []
        for handle in handles:
            res = await self._outcome(request, handle, session)
            if isinstance(res, Response):
                await cancel_all(handles)
                return res
            results.append(res)
        choices: list[dict[str, Any]] = []
        usages = []
        for prompt, res in zip(prompts, results):
            prompt_ids = prompt.get("prompt_token_ids") or res.prompt_token_ids or []
            # prompt-major, as vLLM's server: the n choices of prompt i are indices i*n .. i*n+n-1
            choices += [self._completion_choice(req, res, len(choices) + k, s, prompt_ids) for k, s in enumerate(res.samples)]
            usages.append(self._usage(res, len(prompt_ids) or res.prompt_tokens))
        usage = summed(usages)
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": usage,
                             "system_fingerprint": None, "service_tier": None, "kv_transfer_params": None})

    def _completion_logprobs(self, sample: Any, as_ids: bool | None) -> dict[str, Any]:
        ids, lps = sample.token_ids, sample.token_logprobs or []
        tokens = [self._token_str(t, as_ids) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)]}

    def _completion_choice(self, req: CompletionRequest, res: Result, i: int, s: Any, prompt_ids: list[int]) -> dict[str, Any]:
        return {"index": i, "text": self._text(s),
                "logprobs": self._completion_logprobs(s, req.return_tokens_as_token_ids) if req.logprobs is not None else None,
                "finish_reason": s.finish_reason, "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                "token_ids": s.token_ids if req.return_token_ids else None,
                "rollq": self._ext(res, s)}

    def _chat_prompt(self, req: ChatRequest) -> dict[str, Any]:
        messages = chat_messages(req)
        exact = exact_turns(req)
        if self.tokenizer is None:
            if exact:
                raise InvalidJob("messages[].token_ids need the chat template on the server (rollq serve --tokenizer)")
            return {"messages": messages}
        try:
            ids = template_ids(self.tokenizer, messages, exact, req.add_generation_prompt, req.chat_template_kwargs or {})
        except ValueError as e:
            raise InvalidJob(f"messages[].token_ids: {e}") from e
        return {"prompt_token_ids": ids}

    async def chat(self, request: Request) -> Response:
        req = await self._decode(request, ChatRequest)
        if isinstance(req, Response):
            return req
        try:
            if req.top_logprobs:
                raise InvalidJob("top_logprobs above 0 are not served: a rollq result carries the sampled token's logprob")
            prompt = self._chat_prompt(req)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            session = self._session(request, req)
            handle = await self._submit({**prompt, "sampling": sampling_of(req, max_tokens, req.logprobs), **_stream_field(req)},
                                        session)
        except InvalidJob as e:
            return error_response(str(e), 400)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return sse(streaming.chat_stream(self, req, handle, rid, prompt, session), handle)
        res = await self._outcome(request, handle, session)
        if isinstance(res, Response):
            return res
        prompt_ids = prompt.get("prompt_token_ids") or res.prompt_token_ids or []
        choices: list[dict[str, Any]] = [{"index": i, "message": {"role": "assistant", "content": self._text(s), "refusal": None,
                                            "annotations": None, "audio": None, "function_call": None,
                                            "tool_calls": [], "reasoning": None},
                    "logprobs": self._chat_logprobs(s, req.return_tokens_as_token_ids) if req.logprobs else None, "finish_reason": s.finish_reason,
                    "stop_reason": None, "token_ids": s.token_ids if req.return_token_ids is not False else None,
                    "rollq": self._ext(res, s)} for i, s in enumerate(res.samples)]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "service_tier": None, "system_fingerprint": None,
                             "usage": self._usage(res, len(prompt_ids) or res.prompt_tokens), "prompt_logprobs": None,
                             "prompt_token_ids": prompt_ids if req.return_token_ids is not False else None,
                             "kv_transfer_params": None})

    def _chat_logprobs(self, sample: Any, as_ids: bool | None) -> dict[str, Any]:
        content = []
        for t, lp in zip(sample.token_ids, sample.token_logprobs or []):
            tok = self._token_str(t, as_ids)
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    # -- token in, token out -------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        """``POST /inference/v1/generate`` (see :mod:`rollq.serve.generate`)."""
        req = await self._decode(request, gen.GenerateRequest)
        if isinstance(req, Response):
            return req
        try:
            session = self._session(request, req)
            handle = await self._submit({"prompt_token_ids": req.token_ids, "sampling": gen.generate_sampling(req),
                                         **_stream_field(req)}, session)
        except InvalidJob as e:
            return error_response(str(e), 400)
        rid = f"generate-tokens-{request.headers.get('x-request-id') or req.request_id or uuid.uuid4().hex}"
        if req.stream:
            return sse(streaming.generate_stream(self, req, handle, rid, session), handle)
        res = await self._outcome(request, handle, session)
        if isinstance(res, Response):
            return res
        completion = sum(len(s.token_ids) for s in res.samples)
        return JSONResponse({
            "request_id": rid, "model": self.model_name, "created": int(time.time()),
            "usage": gen.usage(len(req.token_ids), completion),
            "prompt_logprobs": gen.prompt_logprobs(res, req.token_ids), "prompt_token_id_logprobs": None,
            "prompt_token_ids": req.token_ids if req.return_token_ids else None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": req.output_mode,
            "choices": [self._generate_choice(req, res, i, s) for i, s in enumerate(res.samples)]})

    def _generate_choice(self, req: gen.GenerateRequest, res: Result, i: int, s: Any) -> dict[str, Any]:
        ids, lps = s.token_ids, s.token_logprobs or []
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = (gen.text_logprobs(ids, lps, self._token_str) if req.output_mode == "text"
                        else gen.tokens_logprobs(ids, lps))
        choice: dict[str, Any] = {"index": i, "finish_reason": s.finish_reason or "stop", "stop_reason": None,
                                  "token_ids": ids, "routed_experts": None, "sampling_mask": None,
                                  "weight_versions": gen.weight_versions(s.token_versions(res.version_start)),
                                  "logprobs": logprobs}
        if req.output_mode == "text":
            choice["text"] = self._text(s)
        choice["rollq"] = self._ext(res, s)
        return choice


def create_app(producer: Any, *, model_name: str, tokenizer: Any = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, own_producer: bool = True,
               session_margin: int | None = 8, session_ttl: float = 3600.0,
               weights: WeightTransferConfig | None = None) -> Starlette:
    """The app over ``producer`` (a :class:`~rollq.Producer`; connected at startup, closed at
    shutdown when ``own_producer``). ``tokenizer``: a Hugging Face tokenizer of the served model
    (chat template, logprob token strings). ``session_margin``, ``session_ttl``: sticky
    sessions (:class:`~rollq.serve.sessions.Sessions`; None: off). ``weights``: receive a
    trainer's weight updates and publish them as versions of the queue
    (:mod:`rollq.serve.weights`; None: the weight routes answer as vLLM's without a
    weight-transfer engine)."""
    s = _Server(producer, model_name, tokenizer, api_key, max_body_bytes)
    dev = DevRoutes(model_name=model_name, receiver=None, gate=s.gate, keys=producer.keys, redis=lambda: s.redis,
                    authorized=s._authorized, read_body=s._body_or_empty)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await producer.connect()
        s.redis = connect(producer.redis_settings)
        publisher = None
        if session_margin is not None:
            s.sessions = Sessions(s.redis, producer.keys, margin=session_margin, ttl=session_ttl)
        try:
            if weights is not None:
                from ..weightsync.trainer.publisher import WeightPublisher
                from .weights import WeightReceiver

                publisher = WeightPublisher(producer.redis_settings, producer.queue, root=weights.root,
                                            trainer_id=f"rollq-serve-{producer.id}")
                s.receiver = dev.receiver = WeightReceiver(weights, publisher)
                await s.receiver.load_base()
            yield
        finally:
            if publisher is not None:
                await publisher.close()
            await s.redis.aclose()
            if own_producer:
                await producer.close()

    routes = [Route("/health", s.health, methods=["GET"]), Route("/v1/models", s.models, methods=["GET"]),
              Route("/v1/completions", s.completions, methods=["POST"]),
              Route("/v1/chat/completions", s.chat, methods=["POST"]),
              Route("/inference/v1/generate", s.generate, methods=["POST"]), *dev.routes()]
    # Redis errors and a submission Redis cut off answer 503 in vLLM's error body, not 500.
    unreachable = {RedisError: queue_unreachable, SubmitInterrupted: queue_unreachable}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=unreachable)
