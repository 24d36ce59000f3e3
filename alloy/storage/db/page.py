"""One page of a listing."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel
from sqlalchemy import CursorResult, Executable, Select, func, select
from sqlalchemy.orm import Session

from alloy.errors import validation_failed

T = TypeVar("T")

MAX_PAGE_SIZE = 500
# Far past any real listing, and inside every backend's OFFSET type (SQLite and PostgreSQL take 64-bit integers;
# Python's sqlite3 refuses larger ints outright).
MAX_OFFSET = 2**31 - 1


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    offset: int
    limit: int


def check_paging(offset: int, limit: int) -> None:
    if not 0 <= offset <= MAX_OFFSET:
        raise validation_failed(f"offset must be between 0 and {MAX_OFFSET}", offset=offset)
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise validation_failed(f"limit must be between 1 and {MAX_PAGE_SIZE}", limit=limit)


__all__ = ["MAX_OFFSET", "MAX_PAGE_SIZE", "Page", "check_paging"]


def count_rows(session: Session, query: Select[Any]) -> int:
    """How many rows ``query`` selects (a listing's ``total``)."""
    return session.scalar(select(func.count()).select_from(query.subquery())) or 0


def rows_changed(session: Session, statement: Executable) -> int:
    """Execute an UPDATE or DELETE and return how many rows it changed (the compare-and-set answer)."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount
