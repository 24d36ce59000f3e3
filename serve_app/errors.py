"""The one error shape of the HTTP API, and the request id that ties a response to the server's logs.

Every error response, whoever produces it, has the body ``{"error": {"code", "message", "details",
"request_id"}}`` (see :meth:`alloy.errors.AlloyError.to_dict`) and the status that ``alloy.errors.HTTP_STATUS``
assigns to its code. :func:`install_error_handlers` makes that true for Alloy's own errors, for FastAPI's request
validation, for Starlette's routing errors (unknown route, wrong method) and for unexpected exceptions, whose
details are logged server-side under the request id and never sent to the client.

:class:`RequestContextMiddleware` is a pure ASGI middleware (no ``BaseHTTPMiddleware``, so streamed request and
response bodies pass through untouched). It must be the outermost Alloy middleware: it assigns the request id,
adds the headers inner layers ask for (``X-Request-ID`` and the rate-limit headers) to every response, and turns
an exception that escaped everything else into the 500 error body, so even that response carries the headers.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alloy.errors import AlloyError, ErrorCode, public_message
from serve_app.openapi import document_contract

logger = logging.getLogger("alloy.http")

REQUEST_ID_HEADER = "X-Request-ID"
# An incoming id is echoed into headers and logs, so only a short, plain token is accepted; anything else is
# replaced by a fresh id rather than rejected (a bad correlation id is not worth failing a request over).
_REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

# Keys in the ASGI scope's "state" dict (what ``request.state`` reads) shared with serve_app.security.
STATE_REQUEST_ID = "request_id"
STATE_RESPONSE_HEADERS = "alloy_response_headers"  # list[tuple[str, str]] added to the response, errors included

# Starlette HTTPException status -> Alloy code. Statuses not listed fall back by class (4xx/5xx).
_CODE_FOR_STATUS: dict[int, ErrorCode] = {
    400: ErrorCode.VALIDATION_FAILED,
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    422: ErrorCode.VALIDATION_FAILED,
    429: ErrorCode.QUOTA_EXCEEDED,
    503: ErrorCode.SERVICE_UNAVAILABLE,
}


class ErrorBody(BaseModel):
    code: ErrorCode = Field(description="Stable machine-readable error code; see the error table in docs/API.md")
    message: str = Field(description="Human-readable explanation")
    details: dict[str, Any] = Field(default_factory=dict, description="Structured context, code-specific")
    request_id: str | None = Field(None, description="Same value as the X-Request-ID response header")


class ErrorResponse(BaseModel):
    """The body of every error response; use in ``responses={404: {"model": ErrorResponse}}``."""

    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries for the given statuses, all with the ErrorResponse body."""
    from serve_app.openapi import STATUS_DESCRIPTIONS

    return {
        status: {"model": ErrorResponse, "description": STATUS_DESCRIPTIONS.get(status, "Error")} for status in statuses
    }


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, STATE_REQUEST_ID, None)


def error_json_response(
    error: AlloyError, request_id: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The wire response of one AlloyError, with the headers its code calls for."""
    extra = dict(headers or {})
    if error.code is ErrorCode.UNAUTHENTICATED:
        extra.setdefault("WWW-Authenticate", "Bearer")
    retry_after = error.details.get("retry_after_s")
    if error.code is ErrorCode.QUOTA_EXCEEDED and isinstance(retry_after, int):
        extra.setdefault("Retry-After", str(retry_after))
    return JSONResponse(error.to_dict(request_id), status_code=error.http_status, headers=extra)


def _validation_details(errors: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    # Only location, message and type: pydantic's "input" would echo the request (secrets included) and its
    # "ctx" may hold objects that are not JSON.
    return [
        {
            "field": ".".join(str(part) for part in e.get("loc", ())),
            "message": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in errors
    ]


async def _handle_alloy_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AlloyError)
    request_id = request_id_of(request)
    if exc.http_status >= 500:
        logger.warning(
            "request_id=%s %s %s -> %s: %s", request_id, request.method, request.url.path, exc.code.value, exc.message
        )
    shown = public_message(exc.code, exc.message, request_id)
    if shown != exc.message:  # an INTERNAL_ERROR: its text and details stay in the log above
        exc = AlloyError(exc.code, shown)
    return error_json_response(exc, request_id)


async def _handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = _validation_details(exc.errors())
    first = fields[0] if fields else {"field": "request", "message": "invalid"}
    error = AlloyError(ErrorCode.VALIDATION_FAILED, f"{first['field']}: {first['message']}", {"errors": fields})
    return error_json_response(error, request_id_of(request))


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _CODE_FOR_STATUS.get(exc.status_code) or (
        ErrorCode.INTERNAL_ERROR if exc.status_code >= 500 else ErrorCode.VALIDATION_FAILED
    )
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        headers["Allow"] = allowed_methods(request)  # Starlette lists the first matching route's only
    elif isinstance(exc.detail, str) and exc.status_code < 500:
        message = exc.detail
    else:
        message = "request failed"
    error = AlloyError(code, public_message(code, message, request_id_of(request)))
    return error_json_response(error, request_id_of(request), headers)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> str:
    """Every method some route of the app answers on this path: the ``Allow`` of a 405. (Starlette's names the
    first route whose path matched, e.g. ``GET`` alone where ``/models/{id}`` also answers ``DELETE``.) Asked of
    the router with a bare scope per method, so included routers answer as they route."""
    allowed = []
    for method in HTTP_METHODS:
        probe = {
            "type": "http",
            "method": method,
            "path": request.scope["path"],
            "root_path": request.scope.get("app_root_path", ""),
            "headers": [],
            "query_string": b"",
        }
        routes = (route for route in request.app.router.routes if not isinstance(route, Mount))
        if any(route.matches(probe)[0] is Match.FULL for route in routes):
            allowed.append(method)
    return ", ".join(allowed) or "GET, HEAD"  # nothing but a mount (the static assets) matched


def internal_error_response(request_id: str | None) -> JSONResponse:
    error = AlloyError(ErrorCode.INTERNAL_ERROR, public_message(ErrorCode.INTERNAL_ERROR, "", request_id))
    return error_json_response(error, request_id)


def new_request_id() -> str:
    return uuid.uuid4().hex


def _incoming_request_id(scope: Scope, *, trusted: bool) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if trusted:  # the Serve proxy's, which it also puts on the response: used as it is, so all agree
                return text or None
            return text if _REQUEST_ID_PATTERN.match(text) else None
    return None


class RequestContextMiddleware:
    """Outermost Alloy middleware: request id, response headers from inner layers, last-resort 500.

    Which id wins: behind Ray Serve (``proxy_sets_request_id=True``) the proxy's. Its HTTP proxy puts an
    ``X-Request-ID`` on every request (the client's, whatever it is, or a new one) and appends that same value
    to the response after the app has answered, where the app cannot take it back; so the app adds no header
    of its own and uses the proxy's id, as it is, in the error body and in its logs (as Serve's own access log
    does). Without the proxy, this middleware decides: the client's id if it is 1-128 characters of
    ``A-Z a-z 0-9 . _ : -``, else a new one, sent in the one ``X-Request-ID`` header.
    """

    def __init__(self, app: ASGIApp, *, proxy_sets_request_id: bool = False) -> None:
        self.app = app
        self.proxy_sets_request_id = proxy_sets_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = _incoming_request_id(scope, trusted=self.proxy_sets_request_id)
        request_id = incoming or new_request_id()
        add_request_id_header = not (self.proxy_sets_request_id and incoming)
        state = scope.setdefault("state", {})
        state[STATE_REQUEST_ID] = request_id
        extra_headers: list[tuple[str, str]] = state.setdefault(STATE_RESPONSE_HEADERS, [])
        response_started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                headers = list(message.get("headers", []))
                if add_request_id_header:
                    headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
                    headers.append((b"x-request-id", request_id.encode("latin-1")))
                present = {k.lower() for k, _ in headers}
                for name, value in extra_headers:
                    encoded = name.lower().encode("latin-1")
                    if encoded not in present:
                        headers.append((encoded, value.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            # Full detail to the server log, under the request id; nothing of it to the client.
            logger.exception(
                "request_id=%s unhandled error in %s %s", request_id, scope.get("method"), scope.get("path")
            )
            if response_started:
                raise  # too late for an error body; let the server abort the connection
            await internal_error_response(request_id)(scope, receive, send_with_headers)


def install_error_handlers(app: FastAPI, *, behind_serve_proxy: bool = False) -> None:
    """Give every error of ``app`` the one shape and every response an ``X-Request-ID``.

    Call before :func:`serve_app.security.install_security` is fine and after is fine: the request-context
    middleware is always placed outermost among Alloy's middlewares. Pass ``behind_serve_proxy=True`` when the
    app is a Ray Serve ingress (the proxy adds ``X-Request-ID`` to responses itself; see RequestContextMiddleware).
    """
    app.add_exception_handler(AlloyError, _handle_alloy_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    if not any(m.cls is RequestContextMiddleware for m in app.user_middleware):
        app.user_middleware.insert(0, Middleware(RequestContextMiddleware, proxy_sets_request_id=behind_serve_proxy))
    document_contract(app)
