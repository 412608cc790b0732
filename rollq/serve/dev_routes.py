"""vLLM's development-mode routes that TRL's ``VLLMClient`` calls, on ``rollq serve``.

``GET /server_info`` (``weight_transfer_config`` null unless ``--weight-transfer``),
``GET /get_world_size`` (1: ``rollq serve`` is the one receiving rank), the weight-transfer
routes ``POST /init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` (:mod:`rollq.serve.weights`), ``POST /pause``, ``/resume``,
``GET /is_paused`` (:mod:`rollq.serve.pause`) and ``POST /reset_prefix_cache`` (a
``reset-prefix-cache`` hint on the queue's control channel: every replica drops its prefix
cache; loading a version re-salts it anyway). Response bodies and status codes are vLLM's;
``/finish_weight_update`` adds the published version in a ``rollq`` field. Unlike vLLM, these
routes ask for the API key when the server has one (they change what every replica serves).

Without ``--weight-transfer`` the four weight routes answer as vLLM's do without
``--weight-transfer-config``: 500 with "Weight transfer not configured".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..protocol import Control, control_message
from .errors import NOT_CONFIGURED, VALIDATION_ERROR, WeightTransferError, error_response, unauthorized
from .pause import PAUSE_MODES, Gate

if TYPE_CHECKING:  # torch: imported where weight transfer is on
    from .weights import WeightReceiver

log = logging.getLogger(__name__)


class DevRoutes:
    """The routes above over ``receiver`` (None: weight transfer off), ``gate`` and the
    queue's Redis client (``redis()``, for the control channel)."""

    def __init__(self, *, model_name: str, receiver: WeightReceiver | None, gate: Gate, keys: Any,
                 redis: Callable[[], Any], authorized: Callable[[Request], bool],
                 read_body: Callable[[Request], Awaitable[bytes | None]]):
        self.model_name = model_name
        self.receiver = receiver
        self.gate = gate
        self.keys = keys
        self.redis = redis
        self.authorized = authorized
        self.read_body = read_body

    def routes(self) -> list[Route]:
        return [Route("/server_info", self.server_info, methods=["GET"]),
                Route("/get_world_size", self.world_size, methods=["GET"]),
                Route("/init_weight_transfer_engine", self.init, methods=["POST"]),
                Route("/start_weight_update", self.start, methods=["POST"]),
                Route("/update_weights", self.update, methods=["POST"]),
                Route("/finish_weight_update", self.finish, methods=["POST"]),
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/is_paused", self.is_paused, methods=["GET"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])]

    async def _json(self, request: Request) -> dict[str, Any] | Response:
        """The body as a JSON object ({} when empty), or the error response to send."""
        if not self.authorized(request):
            return unauthorized()
        body = await self.read_body(request)
        if body is None:
            return error_response("request body too large (or the client went away)", 413)
        if not body.strip():
            return {}
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            return error_response(f"malformed JSON: {e}", 400, err_type=VALIDATION_ERROR)
        if not isinstance(obj, dict):
            return error_response("the body must be a JSON object", 400, err_type=VALIDATION_ERROR)
        return obj

    # -- configuration -----------------------------------------------------------------------
    async def server_info(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        fmt = request.query_params.get("config_format", "text")
        if fmt not in ("text", "json"):
            return error_response(f"config_format: Input should be 'text' or 'json', got {fmt[:40]!r}", 400,
                                  err_type=VALIDATION_ERROR)
        rx = self.receiver
        wt = {"backend": rx.config.backend} if rx is not None else None
        dtypes = sorted({str(t.dtype) for t in rx.state.values()}) if rx is not None else []
        config = {"model_config": {"model": self.model_name, "served_model_name": self.model_name,
                                   "dtype": dtypes[0] if len(dtypes) == 1 else None},
                  "parallel_config": {"world_size": 1, "world_size_across_dp": 1},
                  "weight_transfer_config": wt}
        shown: Any = config if fmt == "json" else f"model={self.model_name!r}, weight_transfer_config={wt!r}"
        return JSONResponse({"vllm_config": shown, "vllm_env": {}, "system_env": {}})

    async def world_size(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        return JSONResponse({"world_size": 1})

    # -- weight transfer ---------------------------------------------------------------------
    async def _weights(self, request: Request, field: str | None, op: Callable[[WeightReceiver, Any], Awaitable[Any]],
                       message: str) -> Response:
        body = await self._json(request)
        if isinstance(body, Response):
            return body
        if self.receiver is None:
            return error_response(NOT_CONFIGURED, 500)
        if field is not None and not isinstance(body.get(field), dict):
            return error_response(f"1 validation error:\n  {{'type': 'missing', 'loc': ('body', '{field}'), "
                                  f"'msg': 'Field required (a JSON object)'}}", 400, err_type=VALIDATION_ERROR)
        try:
            extra = await op(self.receiver, body.get(field) if field is not None else body)
        except WeightTransferError as e:
            log.warning("%s: %s", request.url.path, str(e)[:500])
            return error_response(str(e), e.status)
        out: dict[str, Any] = {"message": message}
        if extra is not None:
            out["rollq"] = extra
        return JSONResponse(out)

    async def init(self, request: Request) -> Response:
        return await self._weights(request, "init_info", lambda rx, info: rx.init(info), "Weight transfer initialized")

    async def start(self, request: Request) -> Response:
        return await self._weights(request, None, lambda rx, _: rx.start(), "Weight update started")

    async def update(self, request: Request) -> Response:
        async def op(rx: WeightReceiver, info: Any) -> None:
            await rx.update(info)

        return await self._weights(request, "update_info", op, "Weights updated")

    async def finish(self, request: Request) -> Response:
        async def op(rx: WeightReceiver, body: Any) -> dict[str, Any] | None:
            wv = body.get("weight_version")
            rec = await rx.finish(None if wv is None else str(wv))
            if rec is None:
                return None
            return {"version": rec.version, "checksum": rec.checksum, "num_tensors": rec.num_tensors, "nbytes": rec.nbytes}

        return await self._weights(request, None, op, "Weight update finished")

    # -- pause, resume, prefix cache ---------------------------------------------------------
    async def pause(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error_response(f"mode: Input should be 'abort', 'wait' or 'keep', got {mode[:40]!r}", 400,
                                  err_type=VALIDATION_ERROR)
        await self.gate.pause(mode)
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        self.gate.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        return JSONResponse({"is_paused": self.gate.paused})

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not self.authorized(request):
            return unauthorized()
        await self.redis().publish(self.keys.control, control_message(Control.RESET_PREFIX_CACHE))
        return JSONResponse({"success": True})
