"""One page of a listing."""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel

from alloy.errors import validation_failed

T = TypeVar("T")

MAX_PAGE_SIZE = 500


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    offset: int
    limit: int


def check_paging(offset: int, limit: int) -> None:
    if offset < 0:
        raise validation_failed("offset must be >= 0", offset=offset)
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise validation_failed(f"limit must be between 1 and {MAX_PAGE_SIZE}", limit=limit)


__all__ = ["Page", "check_paging"]
