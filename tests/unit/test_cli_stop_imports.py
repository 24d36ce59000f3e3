"""`alloy stop` signals the running `alloy start` before anything slow: its code path must not import Ray.

Importing Ray and Serve takes seconds on a busy machine; the graceful stop then began after the merges that were
active when the operator typed `alloy stop` had finished (tests/e2e/test_lifecycle_process.py found none to wait
for)."""

from __future__ import annotations

import subprocess
import sys

# `alloy stop` against a data dir where nothing runs: the whole stop path up to "is it running?" executes.
STOP_PATH = """
import sys
from click.testing import CliRunner
from alloy.cli.main import cli
result = CliRunner().invoke(cli, ["--data-dir", sys.argv[1], "stop"])
print(result.output.strip().splitlines()[-1] if result.output.strip() else "")
print(sorted(m for m in ("ray", "torch", "transformers") if m in sys.modules))
"""


def test_the_stop_path_imports_neither_ray_nor_torch(tmp_path):
    data_dir = tmp_path / "var"
    (data_dir / "run").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-c", STOP_PATH, str(data_dir)], capture_output=True, text=True, timeout=120, check=True
    )
    said, loaded = out.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", out.stdout + out.stderr
    assert said, out.stdout + out.stderr  # it did answer (not running), so the path above really ran


def test_start_and_stop_share_one_state_file_rule():
    # The runner uses the same state-file helpers (one source): what `alloy stop` writes, `alloy start` reads.
    from alloy.cluster import local_state
    from alloy.control import local_run

    assert local_run.STOP_REQUEST_FILE is local_state.STOP_REQUEST_FILE
    assert local_run.read_local_state is local_state.read_local_state
