"""What the sync and async clients share: where to connect, how to authenticate, how requests are built and
answers checked. Nothing here does I/O."""

from __future__ import annotations

import os
import re
from typing import Any

import httpx
from pydantic import ValidationError

from alloy.client.errors import AlloyAPIError
from alloy.http_port import DEFAULT_HTTP_PORT
from alloy.wire import JobStreamEvent, MergeRequest

ENV_URL = "ALLOY_URL"
ENV_KEY = "ALLOY_API_KEY"
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"  # `alloy start`'s default port
DEFAULT_TIMEOUT_S = 60.0
PROMOTE_TIMEOUT_S = 1800.0  # a promotion merges a Pareto front member to disk: minutes for a large model
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED"})


def resolve_url(base_url: str | None) -> str:
    return (base_url or os.environ.get(ENV_URL) or DEFAULT_URL).rstrip("/")


def resolve_key(api_key: str | None) -> str | None:
    return api_key or os.environ.get(ENV_KEY) or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise AlloyAPIError.from_response(response)
    return response


def merge_body(models: list[str], strategy: str, output_model_id: str, **fields: Any) -> dict[str, Any]:
    """The POST /merge/execute body, validated with the server's own model first (so a typo fails here with
    the server's code, VALIDATION_FAILED, before anything is sent)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        request = MergeRequest(models=models, strategy=strategy, output_model_id=output_model_id, **fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise AlloyAPIError.invalid(f"{field}: {first['msg']}", {"field": field}) from None
    return request.model_dump(mode="json", exclude_none=True)


def stream_event(sse) -> JobStreamEvent:
    return JobStreamEvent(event=sse.event, id=sse.id, data=sse.json())


def best_trial(trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    scored = [t for t in trials if isinstance((t.get("metrics") or {}).get("fitness"), (int, float))]
    return max(scored, key=lambda t: t["metrics"]["fitness"]) if scored else None


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def resumed_offset(response: httpx.Response, asked: int) -> int:
    """Where the body of a (possibly ranged) download starts: ``asked`` on 206, 0 when the server sent it all."""
    if response.status_code == 206:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
        return int(match.group(1)) if match else asked
    return 0
