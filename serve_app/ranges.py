"""HTTP Range for artifact downloads: only the form a resuming client sends, ``bytes=N-`` (the rest of the file
from byte N). Anything else is refused with VALIDATION_FAILED rather than silently answered in full, so a client
never appends a whole file to the part it already has."""

from __future__ import annotations

import re

from alloy.errors import validation_failed

_OPEN_RANGE = re.compile(r"bytes=(\d+)-")


def parse_range_start(header: str | None, size: int) -> int:
    """The first byte to send: 0 without a Range header."""
    if header is None:
        return 0
    match = _OPEN_RANGE.fullmatch(header.strip())
    if match is None:
        raise validation_failed("only open byte ranges are supported (Range: bytes=N-)", field="Range")
    start = int(match.group(1))
    if start >= size:
        raise validation_failed(
            f"range start {start} is past the end of the artifact ({size} bytes)", field="Range", size=size
        )
    return start
