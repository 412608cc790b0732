"""Error bodies shaped as vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param",
"code"}}``, and 401 ``{"error": "Unauthorized"}`` as vLLM's API-key middleware answers."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 500: "InternalServerError",
          503: "ServiceUnavailableError", 504: "TimeoutError"}


#: The error type of a body that does not validate (vLLM: FastAPI's ``RequestValidationError``
#: handler names it by the status phrase); errors found later are ``BadRequestError``.
VALIDATION_ERROR = "Bad Request"


def error_response(message: str, code: int = 400, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    """vLLM's ``ErrorResponse`` body with status ``code``.

    >>> error_response("bad", 400).status_code
    400
    """
    body = {"error": {"message": message, "type": err_type or _TYPES.get(code, "BadRequestError"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=code)


def queue_unreachable(request: Any, exc: Exception) -> JSONResponse:
    """503 for a request that could not reach the queue's Redis (down, or every pooled
    connection busy for ``RedisSettings.pool_timeout``): the client may retry later. A job
    whose submission was cut off may still be queued (``SubmitInterrupted``: in doubt)."""
    return error_response(f"the queue's Redis is out of reach: {type(exc).__name__}: {exc}", 503)


def unauthorized() -> JSONResponse:
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


#: vLLM's worker message for every weight route when no weight-transfer engine is configured.
NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."


class WeightTransferError(Exception):
    """A weight route's failure (:mod:`rollq.serve.weights`); ``status`` is the HTTP status
    vLLM's server gives it."""

    status = 500


class WeightUpdateRefused(WeightTransferError, ValueError):
    """Input that cannot be applied (vLLM answers a ``ValueError`` with 400)."""

    status = 400


class WeightTransferTimeout(WeightTransferError):
    """A rendezvous or receive that outlasted the configured timeout."""

    status = 504
