"""The one exception the client raises: :class:`AlloyAPIError`, carrying the service's error code (the spec's
table: VALIDATION_FAILED, MODEL_NOT_FOUND, QUOTA_EXCEEDED, ...), the HTTP status and the message."""

from __future__ import annotations

from typing import Any

import httpx

from alloy.errors import HTTP_STATUS, ErrorCode

# A response without the service's error body (a proxy in between, a dead server): the code its status stands for.
_CODE_OF_STATUS = {status: code for code, status in reversed(list(HTTP_STATUS.items()))}


class AlloyAPIError(Exception):
    def __init__(
        self,
        code: str,
        status: int | None,
        message: str,
        details: dict[str, Any] | None = None,
        request_id: str | None = None,
    ):
        super().__init__(f"{code} ({status}): {message}" if status else f"{code}: {message}")
        self.code = code
        self.status = status
        self.message = message
        self.details = details or {}
        self.request_id = request_id

    @classmethod
    def from_response(cls, response: httpx.Response) -> AlloyAPIError:
        try:
            body = response.json()["error"]
            return cls(body["code"], response.status_code, body["message"], body.get("details"), body.get("request_id"))
        except (ValueError, KeyError, TypeError):
            code = _CODE_OF_STATUS.get(response.status_code, ErrorCode.INTERNAL_ERROR)
            return cls(code.value, response.status_code, f"HTTP {response.status_code} without an Alloy error body")

    @classmethod
    def unreachable(cls, base_url: str, exc: Exception) -> AlloyAPIError:
        return cls(ErrorCode.SERVICE_UNAVAILABLE.value, None, f"cannot reach {base_url}: {type(exc).__name__}")

    @classmethod
    def invalid(cls, message: str, details: dict[str, Any] | None = None) -> AlloyAPIError:
        """Refused before sending: the same code and status the server would answer."""
        return cls(ErrorCode.VALIDATION_FAILED.value, HTTP_STATUS[ErrorCode.VALIDATION_FAILED], message, details)
