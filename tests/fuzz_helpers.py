"""An OpenAPI-driven fuzz run (schemathesis + Hypothesis) over every operation of a live Alloy HTTP API.

``fuzz_api(base_url, api_key)`` loads ``{base_url}/openapi.json``, and for each operation sends valid
(``positive``) and schema-violating (``negative``) requests generated from the schema, authenticated with
``api_key``. Every response must satisfy :func:`check_response`: no 5xx, rate-limit and request-id headers on
every response, and every error in the one shape with the status its code maps to. Point it at any server:

    from tests.fuzz_helpers import fuzz_api
    report = fuzz_api("http://127.0.0.1:8000", admin_key, max_examples=25)

Use a key with generous limits (``ApiKeyStore.create(..., read_limit="100000/minute", jobs_limit=...)``) so the
run measures behaviour rather than the rate limiter, and the ``admin`` scope so admin routes are reached. Routes
that change the cluster (``/admin/drain``, ``/admin/reload`` ...) can be left out with ``exclude_paths``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from alloy.errors import HTTP_STATUS, ErrorCode

RATE_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
ERROR_FIELDS = {"code", "message", "details", "request_id"}


@dataclass
class FuzzReport:
    operations: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)  # (operation, status) -> count

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


def _header(response: Any, name: str) -> str | None:
    values = response.headers.get(name)
    if isinstance(values, list):
        return values[0] if values else None
    return values


def check_response(response: Any, where: str) -> None:
    """Raise AssertionError unless ``response`` (schemathesis Response or httpx.Response) is well-formed."""
    status = response.status_code
    assert status < 500, f"{where}: server error {status}: {response.text[:500]}"
    for name in RATE_HEADERS:
        value = _header(response, name)
        assert value is not None and value.isdigit(), f"{where}: {status} lacks a valid {name} header"
    request_id = _header(response, "x-request-id")
    assert request_id, f"{where}: {status} lacks X-Request-ID"
    if status < 400:
        return
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: {status} body is not the error shape: {body!r}"
    error = body["error"]
    assert set(error) == ERROR_FIELDS, f"{where}: error fields {sorted(error)}"
    assert error["code"] in ErrorCode.__members__, f"{where}: unknown code {error['code']!r}"
    assert HTTP_STATUS[ErrorCode(error["code"])] == status, f"{where}: {error['code']} sent with status {status}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: empty message"
    assert isinstance(error["details"], dict), f"{where}: details is not an object"
    assert error["request_id"] == request_id, f"{where}: request_id differs from X-Request-ID"
    if status == 401:
        assert _header(response, "www-authenticate"), f"{where}: 401 without WWW-Authenticate"
    if status == 429:
        assert (_header(response, "retry-after") or "").isdigit(), f"{where}: 429 without Retry-After"


def fuzz_api(
    base_url: str,
    api_key: str,
    *,
    max_examples: int = 20,
    modes: Iterable[GenerationMode] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
    exclude_paths: Iterable[str] = (),
    schema_with_key: bool = True,
) -> FuzzReport:
    """Fuzz every operation of the API at ``base_url``; raise AssertionError (with Hypothesis's minimal example)
    on the first malformed response. Returns what was exercised. ``schema_with_key=False`` fetches the (public)
    OpenAPI document without the key, for runs whose key is meant to be refused."""
    auth = {"Authorization": f"Bearer {api_key}"}
    schema = schemathesis.openapi.from_url(
        f"{base_url}/openapi.json", headers=auth if schema_with_key else {}, timeout=30
    )
    excluded = [re.compile(pattern) for pattern in exclude_paths]
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        if any(pattern.search(operation.path) for pattern in excluded):
            continue
        label = f"{operation.method.upper()} {operation.path}"
        report.operations.append(label)
        strategies = [operation.as_strategy(generation_mode=mode) for mode in modes]
        _fuzz_operation(st.one_of(strategies), base_url, auth, label, report, max_examples)
    return report


def _fuzz_operation(
    strategy, base_url: str, auth: dict[str, str], label: str, report: FuzzReport, max_examples: int
) -> None:
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,  # no example database files left in the repository
        derandomize=True,  # the same run every time, so a failure reproduces
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case) -> None:
        response = case.call(base_url=base_url, headers=auth, timeout=30)
        report.statuses[(label, response.status_code)] += 1
        check_response(response, f"{label} ({case.method} {case.formatted_path})")

    run()
