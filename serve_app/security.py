"""Authentication, scopes, per-key rate limits and request-body limits for the HTTP API.

:func:`install_security` adds one pure ASGI middleware (streamed bodies pass through untouched) that, for every
HTTP request, in order:

1. **Authenticates.** The key comes from ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` and is verified
   against the :class:`alloy.storage.keys.ApiKeyStore` (hashed, constant-time compare). Missing, unknown, revoked or
   expired -> 401 UNAUTHENTICATED with ``WWW-Authenticate: Bearer``. Only the API description is public
   (``/openapi.json``, ``/docs``, ``/docs/oauth2-redirect``, ``/redoc``); ``/health`` and everything else need
   a key, as the specification says every request carries one.
2. **Rate-limits** with the ``limits`` library, moving-window strategy, in ``rate_limits.storage_uri``
   (``memory://`` for one ingress replica; ``redis://`` shared by all replicas; hits are atomic there, so the
   limit holds exactly across replicas). Buckets, each per key:

   - ``jobs`` (default ``rate_limits.jobs`` = 10/minute): job creation, ``POST /merge/execute``,
     ``POST /evolutions``, ``POST /evaluations``;
   - ``read`` (default ``rate_limits.read`` = 100/minute): every other request (reads and the other writes).
   - requests without a valid key count against an ``anonymous`` bucket per client IP (``rate_limits.anonymous``), so
     key guessing is throttled too.

   Every response, errors included, carries ``X-RateLimit-Limit`` (the bucket's size), ``X-RateLimit-Remaining``
   (requests left in the current window) and ``X-RateLimit-Reset`` (**seconds**, an integer delta, until the
   oldest request in the window leaves it, i.e. until Remaining next goes up; the same unit as
   ``Retry-After``). Over the limit -> 429 QUOTA_EXCEEDED with ``Retry-After``.
3. **Checks the scope**: ``/admin`` and ``/admin/*`` need ``admin``; other GET/HEAD/OPTIONS need ``read``; other
   methods need ``write`` -> 403 FORBIDDEN otherwise. ``admin`` implies ``write`` implies ``read``.
   :func:`require_scope` is the same check as a FastAPI dependency, for routes that need more.
4. **Limits the body** to ``server.max_body_bytes``: a larger Content-Length is refused at once, and chunked
   bodies are counted as they stream in -> 413 PAYLOAD_TOO_LARGE.

The principal is stored on ``request.state.principal`` (:func:`current_principal` reads it). The key store and
the rate-limit storage are created lazily in the process that serves requests (the Ray Serve replica), never in
the process that builds the app.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import anyio
from fastapi import FastAPI, Request
from limits import RateLimitItem
from limits import parse as parse_limit
from limits.storage import Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode
from alloy.storage.keys import SCOPES, ApiKeyStore, Principal
from serve_app.errors import (
    STATE_REQUEST_ID,
    STATE_RESPONSE_HEADERS,
    RequestContextMiddleware,
    error_json_response,
)

logger = logging.getLogger("alloy.security")

STATE_PRINCIPAL = "principal"
DEFAULT_JOB_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {("POST", "/merge/execute"), ("POST", "/evolutions"), ("POST", "/evaluations")}
)
# Job-sized work behind a path with an id: promoting a Pareto front member merges, registers and scores a model.
JOB_ROUTE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (("POST", re.compile(r"/evolutions/[^/]+/promote")),)


def is_job_route(method: str, path: str, exact: frozenset[tuple[str, str]] = DEFAULT_JOB_ROUTES) -> bool:
    """Whether ``method path`` starts job-sized work: counted against the jobs bucket, refused while draining."""
    path = path.rstrip("/") or "/"
    return (method, path) in exact or any(m == method and p.fullmatch(path) for m, p in JOB_ROUTE_PATTERNS)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ADMIN_PREFIX = "/admin"


# -- rate limiting -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    bucket: str
    limit: int
    remaining: int
    reset_after_s: int  # whole seconds until Remaining next increases

    def headers(self) -> list[tuple[str, str]]:
        return [
            ("X-RateLimit-Limit", str(self.limit)),
            ("X-RateLimit-Remaining", str(self.remaining)),
            ("X-RateLimit-Reset", str(self.reset_after_s)),
        ]

    def error(self) -> AlloyError:
        retry_after = max(1, self.reset_after_s)
        return AlloyError(
            ErrorCode.QUOTA_EXCEEDED,
            f"rate limit of {self.limit} requests per window exceeded for the {self.bucket} bucket; retry in {retry_after} s",
            {"bucket": self.bucket, "limit": self.limit, "retry_after_s": retry_after},
        )


def redact_uri(uri: str) -> str:
    """A storage URI without its password, for logs."""
    scheme, sep, rest = uri.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


class RateLimiter:
    """Moving-window limits in a ``limits`` storage. ``hit`` is atomic in the storage (a Lua script on Redis),
    so concurrent replicas sharing Redis admit exactly ``limit`` requests per window."""

    def __init__(self, storage_uri: str, *, key_prefix: str = "alloy-rl"):
        options = {"key_prefix": key_prefix} if not storage_uri.startswith("memory://") else {}
        # memory:// and redis:// give the synchronous storages the moving-window limiter takes
        self.storage = cast(Storage, storage_from_string(storage_uri, **options))
        self.strategy = MovingWindowRateLimiter(self.storage)
        logger.info("rate limits stored in %s", redact_uri(storage_uri))

    def hit(self, bucket: str, identity: str, rate: str | RateLimitItem) -> RateDecision:
        item = parse_limit(rate) if isinstance(rate, str) else rate
        allowed = self.strategy.hit(item, bucket, identity)
        stats = self.strategy.get_window_stats(item, bucket, identity)
        reset_after = max(0, math.ceil(stats.reset_time - time.time()))
        return RateDecision(allowed, bucket, item.amount, max(0, stats.remaining), reset_after)


# -- the middleware ------------------------------------------------------------------------------------------
@dataclass
class Admission:
    """The outcome of authentication, rate limiting and the scope check for one request."""

    principal: Principal | None = None
    error: AlloyError | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)


class PayloadTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


def presented_key(headers: Headers) -> str | None:
    """The API key of a request: ``Authorization: Bearer <key>`` first, then ``X-API-Key``. An Authorization
    header with another scheme counts as no key from it."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key and api_key.strip() else None


def required_scope(method: str, path: str) -> str:
    if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        return "admin"
    return "read" if method in SAFE_METHODS else "write"


def _route_path(scope: Scope) -> str:
    path = scope.get("path") or "/"
    root = scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path.rstrip("/") or "/"


class SecurityMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        key_store_factory: Callable[[], ApiKeyStore],
        settings: Settings,
        public_paths: frozenset[str],
        job_routes: frozenset[tuple[str, str]],
    ) -> None:
        self.app = app
        self.key_store_factory = key_store_factory
        self.max_body_bytes = settings.server.max_body_bytes
        self.rate_settings = settings.rate_limits
        self.public_paths = public_paths
        self.public_prefixes = tuple(p[:-1] for p in public_paths if p.endswith("/*"))
        self.job_routes = job_routes
        self._lock = threading.Lock()
        self._store: ApiKeyStore | None = None
        self._limiter: RateLimiter | None = None

    # Built on first use, in the serving process (see module docstring).
    def _resources(self) -> tuple[ApiKeyStore, RateLimiter]:
        with self._lock:
            if self._store is None:
                self._store = self.key_store_factory()
            if self._limiter is None:
                self._limiter = RateLimiter(self.rate_settings.storage_uri, key_prefix=self.rate_settings.key_prefix)
            return self._store, self._limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        headers = Headers(scope=scope)
        method, path = scope["method"], _route_path(scope)
        client = (scope.get("client") or ("unknown", 0))[0]
        try:
            admission = await anyio.to_thread.run_sync(self._admit, presented_key(headers), method, path, client)
        except AlloyError as exc:
            admission = Admission(error=exc)
        except Exception:
            # Key store or rate-limit storage down: refuse (fail closed) rather than serve unauthenticated.
            logger.exception("request_id=%s security check failed", state.get(STATE_REQUEST_ID))
            admission = Admission(
                error=AlloyError(ErrorCode.SERVICE_UNAVAILABLE, "authentication is temporarily unavailable")
            )
        state.setdefault(STATE_RESPONSE_HEADERS, []).extend(admission.headers)
        if admission.error is None:
            admission.error = self._body_length_error(headers)
        if admission.error is not None:
            await self._reject(admission.error, scope, receive, send)
            return
        state[STATE_PRINCIPAL] = admission.principal
        try:
            await self.app(scope, self._limited_receive(receive), send)
        except PayloadTooLarge as exc:  # only when the app let it escape (FastAPI handles it itself)
            await self._reject(AlloyError(ErrorCode.PAYLOAD_TOO_LARGE, exc.detail), scope, receive, send)

    async def _reject(self, error: AlloyError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_json_response(error, scope["state"].get(STATE_REQUEST_ID))
        await response(scope, receive, send)

    def _admit(self, key: str | None, method: str, path: str, client: str) -> Admission:
        store, limiter = self._resources()
        principal = store.verify(key) if key is not None else None
        if principal is None:
            decision = limiter.hit("anonymous", client, self.rate_settings.anonymous)
            admission = Admission(headers=decision.headers())
            if not decision.allowed:
                admission.error = decision.error()
            elif key is not None:
                admission.error = AlloyError(ErrorCode.UNAUTHENTICATED, "the API key is invalid, expired or revoked")
            elif not self._public(path):
                admission.error = AlloyError(
                    ErrorCode.UNAUTHENTICATED,
                    "an API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                )
            return admission
        if is_job_route(method, path, self.job_routes):
            decision = limiter.hit("jobs", principal.key_id, principal.limits.jobs or self.rate_settings.jobs)
        else:
            decision = limiter.hit("read", principal.key_id, principal.limits.read or self.rate_settings.read)
        admission = Admission(principal=principal, headers=decision.headers())
        if not decision.allowed:
            admission.error = decision.error()
        elif not self._public(path) and not principal.has_scope(scope := required_scope(method, path)):
            admission.error = _forbidden(principal, scope)
        return admission

    def _public(self, path: str) -> bool:
        return path in self.public_paths or path.startswith(self.public_prefixes)

    def _body_length_error(self, headers: Headers) -> AlloyError | None:
        declared = headers.get("content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            return AlloyError(ErrorCode.VALIDATION_FAILED, "invalid Content-Length header", {"field": "Content-Length"})
        if int(declared) > self.max_body_bytes:
            return AlloyError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request body exceeds the limit of {self.max_body_bytes} bytes",
                {"limit_bytes": self.max_body_bytes},
            )
        return None

    def _limited_receive(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive (chunked uploads have no Content-Length to check up front)."""
        received = 0
        limit = self.max_body_bytes

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(limit)
            return message

        return limited


def _forbidden(principal: Principal, scope: str) -> AlloyError:
    return AlloyError(
        ErrorCode.FORBIDDEN,
        f"this API key lacks the {scope!r} scope",
        {"required_scope": scope, "key_scopes": sorted(principal.scopes)},
    )


# -- FastAPI dependencies ------------------------------------------------------------------------------------
def current_principal(request: Request) -> Principal:
    """The authenticated caller (a FastAPI dependency). 401 if the security middleware admitted no key."""
    principal = getattr(request.state, STATE_PRINCIPAL, None)
    if principal is None:
        raise AlloyError(ErrorCode.UNAUTHENTICATED, "an API key is required")
    return principal


def require_scope(scope: str) -> Callable[[Request], Principal]:
    """A dependency that returns the principal if it holds ``scope`` (or a scope implying it), else 403 FORBIDDEN.
    Use as ``dependencies=[Depends(require_scope("admin"))]`` or ``p: Principal = Depends(require_scope("write"))``."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; expected one of {SCOPES}")

    def dependency(request: Request) -> Principal:
        principal = current_principal(request)
        if not principal.has_scope(scope):
            raise _forbidden(principal, scope)
        return principal

    dependency.__name__ = f"require_{scope}_scope"
    return dependency


# -- installation --------------------------------------------------------------------------------------------
def default_public_paths(app: FastAPI) -> frozenset[str]:
    """The API description and its viewers; nothing that reads or changes data. Extra public paths (the offline
    docs, the web console's assets) come from ``app.state.public_paths``; ``/prefix/*`` makes a whole folder public."""
    paths = {app.openapi_url, app.docs_url, app.redoc_url, *getattr(app.state, "public_paths", ())}
    if app.docs_url and app.swagger_ui_oauth2_redirect_url:
        paths.add(app.swagger_ui_oauth2_redirect_url)
    return frozenset(p.rstrip("/") or "/" for p in paths if p)


def install_security(
    app: FastAPI,
    *,
    key_store_factory: Callable[[], ApiKeyStore],
    settings: Settings,
    public_paths: Iterable[str] | None = None,
    job_routes: Iterable[tuple[str, str]] = DEFAULT_JOB_ROUTES,
) -> None:
    """Install authentication, rate limits, scope checks and body limits on ``app`` (see module docstring).

    ``key_store_factory`` is called once, lazily, in the serving process. ``job_routes`` are the
    ``(METHOD, path)`` pairs counted against the jobs bucket. The middleware is placed just inside the
    request-context middleware of :func:`serve_app.errors.install_error_handlers` (call that too).
    """
    middleware = Middleware(
        SecurityMiddleware,
        key_store_factory=key_store_factory,
        settings=settings,
        public_paths=frozenset(public_paths) if public_paths is not None else default_public_paths(app),
        job_routes=frozenset((m.upper(), p.rstrip("/") or "/") for m, p in job_routes),
    )
    context_at = next((i for i, m in enumerate(app.user_middleware) if m.cls is RequestContextMiddleware), -1)
    app.user_middleware.insert(context_at + 1, middleware)
    _document_security(app)


def _document_security(app: FastAPI) -> None:
    """Declare both key headers as security schemes, required by every operation, in the OpenAPI document."""
    build_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build_openapi()
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["BearerAuth"] = {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"}
        schemes["ApiKeyHeader"] = {"type": "apiKey", "in": "header", "name": "X-API-Key"}
        schema["security"] = [{"BearerAuth": []}, {"ApiKeyHeader": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
