"""Calling a deployment handle and getting Alloy errors back as Alloy errors.

Ray wraps an exception raised inside a replica in ``RayTaskError``; the client must see the original
``AlloyError`` (its code decides the HTTP status), and a replica that is gone must read as SERVICE_UNAVAILABLE,
not as a 500.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from alloy.errors import AlloyError, ErrorCode


def unwrap_error(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, AlloyError):
        return AlloyError(cause.code, cause.message, cause.details)
    if isinstance(exc, RayTaskError) and cause is not None and not isinstance(exc, AlloyError):
        return exc
    if isinstance(exc, AlloyError):
        return AlloyError(exc.code, exc.message, exc.details)
    if isinstance(exc, (RayActorError, asyncio.TimeoutError, TimeoutError)):
        return AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"component unavailable: {type(exc).__name__}")
    return exc


async def call(handle, method: str, *args: Any, timeout_s: float | None = 60.0, **kwargs: Any) -> Any:
    """``await handle.<method>.remote(*args, **kwargs)`` with errors unwrapped and an optional timeout."""
    try:
        response = getattr(handle, method).remote(*args, **kwargs)
        if timeout_s is None:
            return await response
        return await asyncio.wait_for(_await(response), timeout_s)
    except BaseException as exc:
        unwrapped = unwrap_error(exc)
        if unwrapped is exc:
            raise
        raise unwrapped from None


async def _await(response):
    return await response
