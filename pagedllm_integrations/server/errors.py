"""OpenAI's error body for every failure, and the status codes a client can cause.

`{"error": {"message", "type", "param", "code"}}` with 400 for bad input (pydantic's
422 is turned into 400, as OpenAI answers), 401, 404, 413, 503. A 500 is only for a fault of
the server itself, never for something a client sent; its body is generic (an id to find
the log line by), never the exception's text, which may quote the request.
"""

from __future__ import annotations

import json
import logging
import traceback
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in a route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error")


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, error.type, error.param, error.code),
        status_code=error.status_code,
        headers=headers,
    )


def sse_error(error: BaseException, where: str = "stream") -> str:
    """The event a stream sends when it fails after its 200 has gone out: the message of
    an APIError, else (a fault of the server) a generic one with the id of its log line."""
    if isinstance(error, APIError | ValueError):
        api = error if isinstance(error, APIError) else APIError(400, str(error))
        body = error_body(api.message, api.type, api.param, api.code)
    else:
        body = error_body(internal_error_message(error, where), "server_error")
    return f"data: {json.dumps(body)}\n\n"


def internal_error_message(error: BaseException, where: str) -> str:
    """Log a server fault (escaped: its text may quote what a client sent) under a fresh
    id, and the message a client gets instead of the exception's text."""
    incident = "err-" + uuid.uuid4().hex[:16]
    # The frames, but the exception's text only as a repr: one record, no forged lines.
    frames = "".join(traceback.format_tb(error.__traceback__))
    logger.error(
        "internal error %s in %s: %s: %r\nTraceback (most recent call last):\n%s",
        incident, where, type(error).__name__, str(error)[:2000], frames.rstrip(),
    )  # fmt: skip
    return f"internal server error (id {incident}); the server log has the details"


def internal_error_response(request: Request, error: BaseException) -> JSONResponse:
    where = f"{request.method} {request.url.path!r}"
    message = internal_error_message(error, where)
    return error_response(APIError(500, message, type="server_error"))


class GuardedRoute(APIRoute):
    """Routes whose unexpected exceptions become OpenAI's error body, a 500 with an id.

    An exception that leaves a route reaches Starlette's outermost middleware, which answers
    500 and then raises it on to the server, which logs a second traceback and drops the
    connection; answering here keeps the connection and logs it once. Expected errors pass
    through to the handlers that turn them into their status codes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except _HANDLED:
                raise
            except Exception as error:
                return internal_error_response(request, error)

        return guarded


def _describe_validation(error: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one sentence, and the field it concerns."""
    errors = error.errors()
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(first.get("msg", "")), None
    message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"field {param!r}: " if param else "request body: "
    return where + message + more, param


# What the app's exception handlers answer with their own status codes.
_HANDLED = (APIError, RequestValidationError, ValueError, EngineDeadError, StarletteHTTPException)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(error)
        return error_response(APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, error: ValueError) -> JSONResponse:
        # Every ValueError raised while handling a request comes from validating it; the
        # chat layer's errors name the field at fault.
        param = getattr(error, "param", None)
        return error_response(APIError(400, str(error), param=param, code="invalid_value"))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, f"the engine is not running: {error}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "request failed"
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(
            APIError(error.status_code, message), headers=getattr(error, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        return internal_error_response(request, error)
