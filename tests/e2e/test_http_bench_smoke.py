"""``bench/http_bench.py`` keeps working: a smoke run (a few requests, one round) through a real Ray Serve
deployment and a plain uvicorn app must end with both servers answering 200 to every poll and the table
printed. No timing is asserted (the figures belong to the benchmark, not to CI). It failed with 503
SERVICE_UNAVAILABLE when the bench did not walk the cluster state to READY."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray


def test_http_bench_smoke_run_polls_both_servers():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "bench" / "http_bench.py"), "--requests", "20", "--concurrency", "2"]
    done = subprocess.run([*command, "--rounds", "1"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "plain uvicorn" in done.stdout and "ray serve proxy" in done.stdout
    assert "ratio serve/plain" in done.stdout
