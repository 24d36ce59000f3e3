"""Full disks and killed commands: a merge job whose work folder has no room fails INSUFFICIENT_STORAGE before it
writes; `alloy merge` on a full disk (checked before it writes, and a disk that fills up while it writes: a real
tmpfs), SIGTERM to `alloy merge` (a real process), and `alloy status` of a cluster killed with kill -9. Each
command prints ``Error: CODE: message`` in one line and exits non-zero, never a traceback, and leaves no staging
folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from alloy.cli.main import cli

ALLOY = Path(sys.executable).parent / "alloy"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SLOW_SIZE = {"layers": 8, "hidden": 384, "vocab": 8192}  # ~70 MB per model: a merge of seconds


def write_recipe(folder: Path, base: Path, tunes: list[Path]) -> Path:
    recipe = folder / "recipe.yml"
    models = "".join(f"  - model: {t}\n    parameters: {{density: 0.5, weight: 0.5}}\n" for t in tunes)
    recipe.write_text(f"merge_method: ties\nbase_model: {base}\nmodels:\n{models}dtype: float32\n")
    return recipe


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size) -> folder`` on a tmpfs of that size (needs root, as on the CI machine)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        folder = tmp_path / f"disk-{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


@pytest.fixture
def tiny_recipe(tiny_family, tmp_path) -> Path:
    base, tunes = tiny_family
    return write_recipe(tmp_path, base, tunes[:2])


def assert_one_line_error(output: str, code: str) -> None:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: {code}: "), output


def test_a_disk_without_room_for_the_output_is_refused_before_anything_is_written(tiny_recipe, small_disk):
    disk = small_disk("8m")  # the output is tiny, but below the check's margin
    result = CliRunner().invoke(cli, ["merge", str(tiny_recipe), str(disk / "out"), "--quiet"])
    assert result.exit_code == 1
    assert_one_line_error(result.output, "INSUFFICIENT_STORAGE")
    assert "free" in result.output and str(disk) in result.output  # a local command names the folder
    assert list(disk.iterdir()) == []


def test_a_disk_that_fills_up_during_the_write_is_one_line_and_leaves_nothing(tiny_recipe, small_disk, monkeypatch):
    """The free-space check passed (another writer fills the disk afterwards): the executor's ENOSPC."""
    import alloy.cli.merge as merge_cli

    monkeypatch.setattr(merge_cli, "require_free_space", lambda *_args, **_kwargs: None)
    disk = small_disk("64k")  # smaller than the merged model
    result = CliRunner().invoke(cli, ["merge", str(tiny_recipe), str(disk / "out"), "--quiet"])
    assert result.exit_code == 1
    assert_one_line_error(result.output, "INSUFFICIENT_STORAGE")
    assert "No space left on device" in result.output
    assert list(disk.iterdir()) == []  # neither the output nor its staging folder


def test_sigterm_to_alloy_merge_cleans_up_like_sigint(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama", seed=20, **SLOW_SIZE)
    tunes = [tiny_model_factory("llama", seed=s, base=base, **SLOW_SIZE) for s in (21, 22)]
    recipe = write_recipe(tmp_path, base, tunes)
    out = tmp_path / "merged"
    process = subprocess.Popen(
        [str(ALLOY), "merge", str(recipe), str(out), "--quiet"],
        cwd=PROJECT_ROOT,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".merged.staging-*")):  # it is writing its shards
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the merge never started writing"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)

    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert_one_line_error(stderr, "CANCELLED")
    assert "SIGTERM" in stderr
    assert not out.exists() and not list(tmp_path.glob(".merged.staging-*"))


def test_alloy_status_of_a_cluster_killed_outright_says_it_is_dead(tmp_path, monkeypatch):
    """kill -9 of the whole cluster leaves the state READY and the run file behind: status exits 1 and says in one
    line what is wrong (it used to say READY and exit 0)."""
    from alloy.cluster.local_state import STATE_FILE
    from alloy.cluster.state import ClusterStateStore
    from alloy.storage.db import Database

    monkeypatch.setenv("ALLOY_DATA_DIR", str(tmp_path))
    db = Database(f"sqlite:///{tmp_path / 'alloy.db'}")
    db.upgrade()
    state = ClusterStateStore(db)
    state.begin_start("cold")
    state.mark_ready()
    db.close()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / STATE_FILE).parent.mkdir(parents=True)
    (tmp_path / STATE_FILE).write_text(json.dumps({"pid": gone.pid, "url": "http://127.0.0.1:1", "address": "x"}))

    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 1, result.output
    assert_one_line_error(result.output, "the cluster is dead")
    assert f"pid {gone.pid}" in result.output and "READY" in result.output

    as_json = CliRunner().invoke(cli, ["status", "--json"])
    assert as_json.exit_code == 1
    body = json.loads(as_json.stdout)
    assert body["state"] == "READY" and body["alive"] is False and "dead" in body["problem"]


def test_a_merge_job_without_room_for_its_output_fails_insufficient_storage_before_writing(
    tiny_family, small_disk, tmp_path
):
    from alloy.jobs.merge_request import MergeRequest
    from alloy.jobs.merge_runner import MergeJobRunner
    from alloy.jobs.records import JobKind, JobState
    from alloy.jobs.store import JobStore
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database

    base, tunes = tiny_family
    db = Database(f"sqlite:///{tmp_path / 'alloy.db'}")
    db.upgrade()
    registry = ModelRegistry(db, ArtifactStore(tmp_path / "artifacts"), model_roots=[base.parent], data_dir=tmp_path)
    for model_id, folder in (("base", base), ("tune1", tunes[0]), ("tune2", tunes[1])):
        registry.register(model_id, folder)
    jobs = JobStore(db)
    work = small_disk("8m")
    request = MergeRequest(models=["tune1", "tune2"], strategy="slerp", parameters={"t": 0.5}, output_model_id="out")
    job_id = jobs.create(JobKind.MERGE, request.model_dump(mode="json")).id

    record = MergeJobRunner(jobs, registry, work).run(job_id)
    db.close()

    assert record.state is JobState.FAILED and record.error.code == "INSUFFICIENT_STORAGE", record.error
    assert "the merge work folder" in record.error.message and str(work) not in record.error.message
    assert not registry.exists("out") and list(work.iterdir()) == []
