"""One rule says which requests start job-sized work: the jobs rate bucket and the drain gate both read it."""

from __future__ import annotations

import inspect

import pytest

from serve_app import api, security
from serve_app.security import is_job_route


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/merge/execute", True),
        ("POST", "/evaluations/", True),
        ("POST", "/evolutions", True),
        ("POST", "/evolutions/3f2a9c/promote", True),  # merges, registers and scores a model
        ("POST", "/evolutions/3f2a9c/promote/", True),
        ("GET", "/evolutions/3f2a9c/promote", False),
        ("POST", "/evolutions/3f2a9c/cancel", False),
        ("POST", "/evolutions/a/b/promote", False),
        ("GET", "/merge/execute", False),
        ("POST", "/models", False),
    ],
)
def test_job_routes(method, path, expected):
    assert is_job_route(method, path) is expected


def test_the_drain_gate_and_the_rate_limiter_share_the_rule():
    assert "is_job_route(" in inspect.getsource(api.cluster_gate)
    assert "is_job_route(" in inspect.getsource(security.SecurityMiddleware)
