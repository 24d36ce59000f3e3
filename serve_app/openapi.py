"""The OpenAPI document as a contract: every status each operation can answer, with the one error envelope, and
the links from what an operation creates to the operations that read, follow or remove it.

Statuses. Any request can meet the security middleware (401, 403, 413, 429), request validation (422), routing
(404, 405), the cluster-state gate and unreachable dependencies (503) and, by a bug, 500: those are declared on
every operation (:data:`COMMON_ERRORS`). Statuses only some operations answer are declared with them
(:data:`OPERATION_STATUSES`). The fuzz run (tests/e2e/test_fuzz_serve_app.py) fails on any status an operation
answers that its entry here does not declare.

Links. OpenAPI ``links`` (:data:`LINKS`): a 202 from ``POST /merge/execute`` leads to ``GET /jobs/{job_id}`` with
the answer's ``job_id``, a 201 from ``POST /models`` to ``GET``/``DELETE /models/{model_id}``, and so on; clients
generated from the document and stateful fuzzers follow them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

ERROR_SCHEMA_NAME = "ErrorResponse"
ERROR_REF = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}

STATUS_DESCRIPTIONS = {
    206: "The rest of the artifact from the requested offset (Range: bytes=N-)",
    401: "Missing, invalid, expired or revoked API key (UNAUTHENTICATED)",
    403: "The API key lacks the required scope (FORBIDDEN)",
    404: "Unknown route or resource (NOT_FOUND, MODEL_NOT_FOUND)",
    405: "Method not allowed on this route (METHOD_NOT_ALLOWED; Allow lists the methods)",
    409: "Conflict with the current state (ALREADY_EXISTS, CONFLICT)",
    413: "Request body larger than the configured limit (PAYLOAD_TOO_LARGE)",
    422: "The request failed validation (VALIDATION_FAILED, INVALID_STRATEGY, INCOMPATIBLE_MODELS)",
    429: "Rate limit exceeded (QUOTA_EXCEEDED); see Retry-After",
    500: "Unexpected server error (INTERNAL_ERROR): no internals, the log has them under the request_id",
    503: "Starting, draining or a dependency down (SERVICE_UNAVAILABLE, SCHEMA_MISMATCH, GPU_UNAVAILABLE)",
}
COMMON_ERRORS = (401, 403, 404, 405, 413, 422, 429, 500, 503)

# (method, path as in the document) -> the statuses it adds to COMMON_ERRORS, and why.
OPERATION_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("POST", "/merge/execute"): (409,),  # output id registered or claimed by an active merge
    ("POST", "/models"): (409,),  # id registered, or being produced by an active merge
    ("POST", "/datasets"): (409,),  # id registered
    ("GET", "/evaluations/{job_id}/results"): (409,),  # the evaluation has not COMPLETED
    ("POST", "/evolutions/{job_id}/cancel"): (409,),  # the evolution already ended
    ("POST", "/evolutions/{job_id}/promote"): (409,),  # not COMPLETED, no Pareto front, or the model id is taken
    ("POST", "/admin/drain"): (409,),  # no worker node can be drained
    ("GET", "/artifacts/{key}/content"): (206,),  # a resumed download
}


@dataclass(frozen=True)
class Link:
    """``source`` answering ``status`` leads to ``target``, its parameters taken from the answer."""

    source: tuple[str, str]
    status: str
    name: str
    target: tuple[str, str]
    parameters: dict[str, str] = field(default_factory=dict)


def _links_to(source: tuple[str, str], status: str, expression: str, *targets: tuple[str, str, str, str]) -> list[Link]:
    return [Link(source, status, name, (method, path), {param: expression}) for name, method, path, param in targets]


JOB_ID = "$response.body#/job_id"
LINKS: list[Link] = [
    *_links_to(
        ("POST", "/merge/execute"),
        "202",
        JOB_ID,
        ("GetJob", "GET", "/jobs/{job_id}", "job_id"),
        ("GetJobEvents", "GET", "/jobs/{job_id}/events", "job_id"),
    ),
    *_links_to(
        ("POST", "/evaluations"),
        "202",
        JOB_ID,
        ("GetEvaluation", "GET", "/evaluations/{job_id}", "job_id"),
        ("GetEvaluationResults", "GET", "/evaluations/{job_id}/results", "job_id"),
        ("GetJob", "GET", "/jobs/{job_id}", "job_id"),
    ),
    *_links_to(
        ("POST", "/evolutions"),
        "202",
        JOB_ID,
        ("GetEvolution", "GET", "/evolutions/{job_id}", "job_id"),
        ("GetEvolutionTrials", "GET", "/evolutions/{job_id}/trials", "job_id"),
        ("CancelEvolution", "POST", "/evolutions/{job_id}/cancel", "job_id"),
        ("PromoteEvolutionMember", "POST", "/evolutions/{job_id}/promote", "job_id"),
        ("GetJob", "GET", "/jobs/{job_id}", "job_id"),
    ),
    *_links_to(
        ("POST", "/models"),
        "201",
        "$response.body#/id",
        ("GetModel", "GET", "/models/{model_id}", "model_id"),
        ("DeleteModel", "DELETE", "/models/{model_id}", "model_id"),
    ),
    *_links_to(
        ("POST", "/datasets"),
        "201",
        "$response.body#/id",
        ("GetDataset", "GET", "/datasets/{dataset_id}", "dataset_id"),
        ("DeleteDataset", "DELETE", "/datasets/{dataset_id}", "dataset_id"),
    ),
    *_links_to(
        ("POST", "/admin/keys"),
        "201",
        "$response.body#/key_id",
        ("RevokeKey", "DELETE", "/admin/keys/{key_id}", "key_id"),
    ),
    *_links_to(
        ("GET", "/jobs"),
        "200",
        "$response.body#/items/0/job_id",
        ("GetJob", "GET", "/jobs/{job_id}", "job_id"),
        ("GetJobEvents", "GET", "/jobs/{job_id}/events", "job_id"),
    ),
    *_links_to(
        ("GET", "/models"),
        "200",
        "$response.body#/items/0/id",
        ("GetModel", "GET", "/models/{model_id}", "model_id"),
    ),
    *_links_to(
        ("GET", "/datasets"),
        "200",
        "$response.body#/items/0/id",
        ("GetDataset", "GET", "/datasets/{dataset_id}", "dataset_id"),
    ),
    *_links_to(
        ("GET", "/experiments"),
        "200",
        "$response.body#/items/0/id",
        ("GetExperiment", "GET", "/experiments/{experiment_id}", "experiment_id"),
    ),
    *_links_to(
        ("GET", "/artifacts"),
        "200",
        "$response.body#/0/key",
        ("GetArtifact", "GET", "/artifacts/{key}", "key"),
        ("DownloadArtifact", "GET", "/artifacts/{key}/content", "key"),
    ),
]


def document_contract(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document declare the statuses and links above (idempotent: once per app)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        _add_error_schema(schema)
        _declare_statuses(schema)
        _declare_links(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_schema(schema: dict[str, Any]) -> None:
    from serve_app.errors import ErrorResponse  # serve_app.errors installs this module's hook

    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in error_schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(ERROR_SCHEMA_NAME, error_schema)


def _operations(schema: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): operation
        for path, item in schema.get("paths", {}).items()
        for method, operation in item.items()
        if isinstance(operation, dict) and "responses" in operation
    }


def _declare_statuses(schema: dict[str, Any]) -> None:
    for key, operation in _operations(schema).items():
        responses = operation["responses"]
        if key[0] == "DELETE" and "204" in responses:
            responses["204"].pop("content", None)  # FastAPI declares a JSON body the 204 never has
        for status in (*COMMON_ERRORS, *OPERATION_STATUSES.get(key, ())):
            entry = responses.setdefault(str(status), {"description": STATUS_DESCRIPTIONS[status]})
            if status >= 400:
                entry["content"] = {"application/json": {"schema": ERROR_REF}}
            elif status == 206:
                entry["content"] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


def _declare_links(schema: dict[str, Any]) -> None:
    operations = _operations(schema)
    for link in LINKS:
        source, target = operations.get(link.source), operations.get(link.target)
        if source is None or target is None or link.status not in source["responses"]:
            continue  # an app built without that router (a test app, the uvicorn benchmark)
        links = source["responses"][link.status].setdefault("links", {})
        links[link.name] = {"operationId": target["operationId"], "parameters": dict(link.parameters)}
