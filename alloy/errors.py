"""The one error type of Alloy.

Every failure a client can see is an :class:`AlloyError` carrying one code. The first six codes are the
service specification's; the rest are the ones an HTTP service cannot do without (authentication, unknown
resources, conflicts, readiness). Each code has exactly one HTTP status, so the mapping lives here and
nowhere else.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    # From the service specification.
    INCOMPATIBLE_MODELS = "INCOMPATIBLE_MODELS"
    INVALID_STRATEGY = "INVALID_STRATEGY"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    GPU_UNAVAILABLE = "GPU_UNAVAILABLE"
    VALIDATION_FAILED = "VALIDATION_FAILED"
    # Added by Alloy (documented in docs/API.md's error table).
    UNAUTHENTICATED = "UNAUTHENTICATED"
    FORBIDDEN = "FORBIDDEN"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CONFLICT = "CONFLICT"
    CANCELLED = "CANCELLED"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"
    SERVICE_UNAVAILABLE = "SERVICE_UNAVAILABLE"
    INSUFFICIENT_STORAGE = "INSUFFICIENT_STORAGE"
    INTERNAL_ERROR = "INTERNAL_ERROR"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INCOMPATIBLE_MODELS: 422,
    ErrorCode.INVALID_STRATEGY: 422,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.QUOTA_EXCEEDED: 429,
    ErrorCode.GPU_UNAVAILABLE: 503,
    ErrorCode.VALIDATION_FAILED: 422,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.CONFLICT: 409,
    ErrorCode.CANCELLED: 409,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.SCHEMA_MISMATCH: 503,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
    ErrorCode.INSUFFICIENT_STORAGE: 507,
    ErrorCode.INTERNAL_ERROR: 500,
}


class AlloyError(Exception):
    """A failure with a stable code, a human message and optional structured details."""

    def __init__(self, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None):
        self.code = ErrorCode(code)
        self.message = message
        self.details = details or {}
        super().__init__(f"{self.code.value}: {message}")

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_dict(self, request_id: str | None = None) -> dict[str, Any]:
        """The wire shape: ``{"error": {"code", "message", "details", "request_id"}}``."""
        return {
            "error": {
                "code": self.code.value,
                "message": self.message,
                "details": self.details,
                "request_id": request_id,
            }
        }

    def __reduce__(self):  # keep the code across Ray's process boundaries
        return (AlloyError, (self.code.value, self.message, self.details))


def validation_failed(message: str, **details: Any) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, message, details)


def from_validation_error(exc: Any, what: str, **details: Any) -> AlloyError:
    """VALIDATION_FAILED for a pydantic ``ValidationError``: the message names the first bad field, the details
    list every one (``{"field", "errors": [{"field", "message"}]}``)."""
    errors = [{"field": ".".join(map(str, e["loc"])) or "body", "message": e["msg"]} for e in exc.errors()]
    first = errors[0]
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"{what}: {first['field']}: {first['message']}",
        {"field": first["field"], "errors": errors, **details},
    )


def model_not_found(model_id: str) -> AlloyError:
    return AlloyError(ErrorCode.MODEL_NOT_FOUND, f"model {model_id!r} is not registered", {"model_id": model_id})


def not_found(kind: str, identifier: str) -> AlloyError:
    return AlloyError(ErrorCode.NOT_FOUND, f"{kind} {identifier!r} does not exist", {kind: identifier})


# -- what a client may read of an internal failure -----------------------------------------------------------
# An unexpected failure's own text (a library's message, a server path, SQL) is for the server log only; the
# client gets this, with the reference under which the log has the detail (a request id or a job id).
INTERNAL_MESSAGE = "internal error; the server log has the details under reference {reference}"


def public_message(code: ErrorCode | str, message: str, reference: str | None) -> str:
    """The message a client may see for an error with ``code``: its own for every spec and client error, the
    generic :data:`INTERNAL_MESSAGE` for INTERNAL_ERROR (the one mechanism every client-facing path uses: the
    HTTP error envelope and the error recorded on a FAILED job)."""
    if getattr(code, "value", code) == ErrorCode.INTERNAL_ERROR.value:
        return INTERNAL_MESSAGE.format(reference=reference or "unknown")
    return message
