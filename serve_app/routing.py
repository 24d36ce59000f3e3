"""Small helpers every router module uses: the scope a route needs, the caller's owner name, paging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Query, Request

from alloy.storage.db.page import MAX_OFFSET, MAX_PAGE_SIZE
from serve_app.security import require_scope

# The paging query parameters of every listing: bounded in the schema, so that no number reaches SQL unchecked.
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="Items to skip")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="Items per page")]


def scope(name: str) -> list[Any]:
    """``dependencies=`` of a route that needs scope ``name``."""
    return [Depends(require_scope(name))]


def owner(request: Request) -> str | None:
    principal = getattr(request.state, "principal", None)
    return getattr(principal, "owner", None)


def page(result: Any, convert: Callable[[Any], Any]) -> dict[str, Any]:
    return {
        "items": [convert(item) for item in result.items],
        "total": result.total,
        "offset": result.offset,
        "limit": result.limit,
    }


def dump(record: Any) -> dict[str, Any]:
    return record.model_dump(mode="json") if hasattr(record, "model_dump") else dict(record)
