"""OpenAPI-driven fuzz runs (schemathesis + Hypothesis) over every operation of a live Alloy HTTP API.

Two drivers share one oracle (:func:`check_response`):

- :func:`run_schemathesis` runs ``schemathesis run`` itself (the CLI, as CI runs it) with the project's config
  ``tests/e2e/schemathesis.toml``: every built-in check (no 5xx, only documented statuses, response schemas,
  negative data refused, positive data accepted, 405 with ``Allow``, auth not ignored, use after free, ...),
  positive and negative data, the stateful phase over the document's OpenAPI links, a fixed seed; this module is
  also its hooks module, adding :func:`alloy_error_contract` (the oracle) as a check and recording every
  (operation, status) pair for the caller.
- :func:`fuzz_api` drives Hypothesis directly, per operation (used for the auth/limits test app).

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

import json
import os
import re
import subprocess
import sys
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from alloy.errors import HTTP_STATUS, ErrorCode
from alloy.wire import MergeRequest, ModelRegistration

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


# -- the schemathesis CLI run ----------------------------------------------------------------------------------
SCHEMATHESIS_CONFIG = Path(__file__).resolve().parent / "e2e" / "schemathesis.toml"
STATUS_LOG_ENV = "ALLOY_FUZZ_STATUS_LOG"  # where the hook records "<METHOD> <path> <status>" lines
FIXTURES_ENV = "ALLOY_FUZZ_FIXTURES"  # FuzzFixtures as JSON


@dataclass
class FuzzFixtures:
    """What the run's valid requests may name: two registered models to merge, folders to register, and how
    many generated requests of each kind to turn into one that succeeds."""

    models: list[str]
    sources: list[str]
    merges: int = 8
    registrations: int = 3


_spent: Counter = Counter()


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    """Turn some schema-valid (positive) bodies of ``POST /merge/execute`` and ``POST /models`` into requests
    that succeed, keeping their generated ids: random models and folders never exist, so without this the 202
    and 201 answers, and the links they lead along (``GET /jobs/{job_id}``, ``DELETE /models/{model_id}``),
    would never be reached. Half of the valid bodies (by a hash of the body: deterministic), up to the
    fixture's budget; schema-violating bodies are left as they are."""
    raw = os.environ.get(FIXTURES_ENV)
    operation = getattr(context, "operation", None)
    if not raw or operation is None or not isinstance(body, dict):
        return body
    fixtures = FuzzFixtures(**json.loads(raw))
    label = f"{operation.method.upper()} {operation.path}"
    if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2:
        return body
    if label == "POST /merge/execute" and _valid(MergeRequest, body) and _spend(label, fixtures.merges):
        return {
            "models": fixtures.models[:2],
            "strategy": "slerp",
            "parameters": {"t": 0.5},
            "output_model_id": body["output_model_id"],
        }
    if label == "POST /models" and _valid(ModelRegistration, body) and _spend(label, fixtures.registrations):
        return {**body, "source": fixtures.sources[_spent[label] % len(fixtures.sources)]}
    return body


def _valid(model: Any, body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except ValueError:
        return False
    return True


def _spend(label: str, budget: int) -> bool:
    if _spent[label] >= budget:
        return False
    _spent[label] += 1
    return True


@schemathesis.check
def alloy_error_contract(ctx: Any, response: Any, case: Any) -> bool | None:
    """The project's oracle (:func:`check_response`) as a schemathesis check; also records the status."""
    log = os.environ.get(STATUS_LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"{case.operation.method.upper()} {case.operation.path} {response.status_code}\n")
    check_response(response, f"{case.operation.label} ({case.method} {case.formatted_path})")
    return None


@dataclass
class SchemathesisRun:
    returncode: int
    output: str
    statuses: Counter  # (operation, status) -> count
    report: dict[str, Any]

    @property
    def operations(self) -> set[str]:
        return {operation for operation, _ in self.statuses}


def run_schemathesis(
    base_url: str,
    api_key: str,
    work_dir: Path,
    *,
    fixtures: FuzzFixtures | None = None,
    extra_args: Iterable[str] = (),
    timeout_s: float = 600,
) -> SchemathesisRun:
    """``schemathesis run`` over ``{base_url}/openapi.json`` with the project's config, authenticated with
    ``api_key``; returns its exit code, its output, the JSON report and every (operation, status) seen.
    ``fixtures``: what valid requests may name (see :func:`map_body`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    status_log = work_dir / "statuses.txt"
    status_log.unlink(missing_ok=True)
    report = work_dir / "report.json"
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file",
        str(SCHEMATHESIS_CONFIG),
        "run",
        f"{base_url}/openapi.json",
        "--header",
        f"Authorization: Bearer {api_key}",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        "--no-color",
        *extra_args,
    ]
    repository = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, STATUS_LOG_ENV: str(status_log), "PYTHONPATH": repository}
    if fixtures is not None:
        env[FIXTURES_ENV] = json.dumps(fixtures.__dict__)
    done = subprocess.run(
        command, cwd=repository, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    statuses: Counter = Counter()
    if status_log.exists():
        for line in status_log.read_text().splitlines():
            method, path, status = line.rsplit(" ", 2)
            statuses[(f"{method} {path}", int(status))] += 1
    document = json.loads(report.read_text()) if report.exists() else {}
    return SchemathesisRun(done.returncode, done.stdout + done.stderr, statuses, document)
