"""Integrity end to end, without Ray: every file's sha256 recorded at registration and verified before a merge,
an evaluation or an evolution reads it (ModelRegistry.local_dir, the merge engine's model cache, a download from
S3), at the start-up consistency check; damaged models are marked broken, listed as such and refused until
registered again; a registration never overwrites a published folder; put_dir fsyncs before it publishes.
SQLite and a local store unless a test says otherwise (the S3 download check uses the moto server)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database

WEIGHTS = "model.safetensors"


@pytest.fixture
def db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'alloy.db'}")
    database.upgrade()
    yield database
    database.close()


@pytest.fixture
def source(tiny_model_factory, tmp_path) -> Path:
    """A private copy of a tiny llama (tests damage it)."""
    folder = tmp_path / "roots" / "tiny"
    shutil.copytree(tiny_model_factory("llama", seed=0), folder)
    return folder


@pytest.fixture
def registry(db, source, tmp_path) -> ModelRegistry:
    return ModelRegistry(db, ArtifactStore(tmp_path / "artifacts"), model_roots=[source.parent], data_dir=tmp_path)


def flip_a_byte(path: Path) -> None:
    """Bit rot of the same size: one byte of the tensor data inverted in place."""
    data = bytearray(path.read_bytes())
    data[-17] ^= 0xFF
    path.write_bytes(data)


def assert_damaged(caught: pytest.ExceptionInfo, model_id: str, tmp_path: Path) -> None:
    error = caught.value
    assert error.code is ErrorCode.VALIDATION_FAILED
    assert f"model {model_id!r} is damaged" in error.message and WEIGHTS in error.message, error.message
    assert error.details["model_id"] == model_id and error.details["file"] == WEIGHTS
    assert str(tmp_path) not in error.message  # never a server path


def test_a_bit_flip_is_refused_naming_the_model_and_the_file_and_marks_it_broken(registry, tmp_path):
    registry.register("flipped", registry.allowed_roots[0] / "tiny")
    assert registry.local_dir("flipped").is_dir()  # verified once, remembered
    flip_a_byte(registry.store.local_path("models/flipped") / WEIGHTS)

    with pytest.raises(AlloyError) as caught:
        registry.local_dir("flipped")
    assert_damaged(caught, "flipped", tmp_path)
    assert WEIGHTS in registry.get("flipped").broken
    assert [m.broken is not None for m in registry.list().items] == [True]
    with pytest.raises(AlloyError) as again:  # refused as an input at validation (ingress) too
        registry.manifest("flipped")
    assert again.value.code is ErrorCode.VALIDATION_FAILED and "damaged" in again.value.message

    registry.delete("flipped")  # registered again: usable again
    registry.register("flipped", registry.allowed_roots[0] / "tiny")
    assert registry.get("flipped").broken is None and registry.local_dir("flipped").is_dir()


def test_a_truncated_file_is_refused_naming_the_model_and_the_file(registry, source, tmp_path):
    registry.register("in-place", source, copy_into_store=False)
    weights = source / WEIGHTS
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(AlloyError) as caught:
        registry.local_dir("in-place")
    assert_damaged(caught, "in-place", tmp_path)
    assert "bytes" in caught.value.message


def test_the_merge_engines_model_cache_verifies_a_file_rewritten_since_its_last_use(db, registry, tmp_path):
    from alloy.jobs.merge_runner import MergeJobRunner
    from alloy.jobs.store import JobStore

    registry.register("cached", registry.allowed_roots[0] / "tiny")
    runner = MergeJobRunner(JobStore(db), registry, tmp_path / "work")
    assert runner.cache.get("cached").local_dir.is_dir()
    assert runner.cache.get("cached").local_dir.is_dir()  # a hit
    flip_a_byte(registry.store.local_path("models/cached") / WEIGHTS)
    with pytest.raises(AlloyError) as caught:
        runner.cache.get("cached")
    assert_damaged(caught, "cached", tmp_path)


def test_a_corrupt_download_from_s3_is_refused_and_marks_the_model_broken(db, source, tmp_path, s3_server):
    store = ArtifactStore(s3_server.new_uri(), s3_server.storage_options)
    registry = ModelRegistry(db, store, model_roots=[source.parent], data_dir=tmp_path)
    registry.register("remote", source)
    key = f"{store.root}/models/remote/{WEIGHTS}"
    data = bytearray(store.fs.cat_file(key))
    data[-17] ^= 0xFF
    store.fs.pipe_file(key, bytes(data))  # the stored object no longer matches its manifest
    with pytest.raises(AlloyError) as caught:
        registry.local_dir("remote")
    assert_damaged(caught, "remote", tmp_path)
    assert registry.get("remote").broken is not None


def test_processes_that_want_a_model_at_once_download_it_once_on_their_node(db, source, tmp_path, s3_server):
    """Engine replicas and merge groups on one node share its cache. Each first use used to download the model and
    publish it by replacing the folder, under a merge already checking the first copy (which then found its
    files missing and marked the model broken): now one downloads, the others wait and find it complete."""
    store = ArtifactStore(s3_server.new_uri(), s3_server.storage_options)
    ModelRegistry(db, store, model_roots=[source.parent], data_dir=tmp_path).register("shared", source)
    downloads, together = [], threading.Barrier(4)
    real_get_dir = ArtifactStore.get_dir

    def get_dir(self, *args, **kwargs):
        downloads.append(threading.get_ident())
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait(timeout=1.0)  # without the lock, all four download at once
        return real_get_dir(self, *args, **kwargs)

    def first_use() -> Path:  # one registry per thread, as each process has its own
        return ModelRegistry(db, store, model_roots=[source.parent], data_dir=tmp_path).local_dir("shared")

    with mock.patch.object(ArtifactStore, "get_dir", get_dir), ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: first_use(), range(4)))
    assert len(downloads) == 1 and len(set(folders)) == 1
    assert (folders[0] / WEIGHTS).read_bytes() == (source / WEIGHTS).read_bytes()
    assert ModelRegistry(db, store, data_dir=tmp_path).get("shared").broken is None


def test_a_damaged_cached_copy_is_downloaded_again_and_the_model_stays_usable(db, source, tmp_path, s3_server):
    """A node's copy is not the model: bit rot in the cache costs a download, not the model (a damaged stored
    file still marks it broken: test_a_corrupt_download_from_s3_is_refused_and_marks_the_model_broken)."""
    store = ArtifactStore(s3_server.new_uri(), s3_server.storage_options)
    registry = ModelRegistry(db, store, model_roots=[source.parent], data_dir=tmp_path)
    registry.register("rotten", source)
    cached = registry.local_dir("rotten")
    flip_a_byte(cached / WEIGHTS)
    again = registry.local_dir("rotten")
    assert again == cached and (again / WEIGHTS).read_bytes() == (source / WEIGHTS).read_bytes()
    assert registry.get("rotten").broken is None


def test_the_start_up_check_verifies_every_sha256_and_marks_or_clears_broken_models(db, registry, tmp_path):
    from alloy.cluster.recovery import Recovery

    registry.register("checked", registry.allowed_roots[0] / "tiny")
    weights = registry.store.local_path("models/checked") / WEIGHTS
    original = weights.read_bytes()
    flip_a_byte(weights)
    recovery = Recovery(db, registry.store, models=registry)

    report = recovery.check()
    [broken] = report.broken_records
    assert (broken.registry, broken.id) == ("models", "checked") and WEIGHTS in broken.reason
    recovery.repair(report)
    assert "start-up consistency check" in registry.get("checked").broken

    weights.write_bytes(original)  # the operator restored the file
    report = recovery.check()
    assert report.broken_records == [] and report.verified_models == ["checked"]
    recovery.repair(report)
    assert registry.get("checked").broken is None


def test_registration_never_overwrites_a_published_folder(registry, source, tmp_path):
    """A published folder without a record (an unfinished registration, or one in flight) is never replaced."""
    other = tmp_path / "roots" / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    registry.store.put_dir("models/taken", other)
    before = registry.store.dir_manifest("models/taken")

    with pytest.raises(AlloyError) as caught:
        registry.register("taken", source)
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    assert registry.store.dir_manifest("models/taken") == before
    assert not registry.exists("taken")


def test_put_dir_fsyncs_files_and_folders_before_the_rename_that_publishes(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst, *args, **kwargs) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.json").write_text("{}")
    (folder / "sub" / "b.txt").write_text("b")
    store = ArtifactStore(tmp_path / "artifacts")

    store.put_dir("models/durable", folder)

    publish = events.index(("rename", str(store.local_path("models/durable"))))
    synced_before = {Path(path).name for kind, path in events[:publish] if kind == "fsync"}
    assert {"a.json", "b.txt", ".alloy-dir.json", "sub"} <= synced_before  # files and folders
    assert any(Path(path).name.startswith("models~durable.") for _, path in events[:publish])  # the staged folder
    assert ("fsync", str(store.local_path("models"))) in events[publish:]  # the rename itself


def test_discard_staging_removes_only_the_leftovers_of_its_prefix(tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    staging = store.local_path("models").parent / ".staging"
    for name in ("models~org~out.1f2e", "models~org~out.3a4b", "models~org~outer.5c6d", "0123abcd"):
        (staging / name).mkdir(parents=True)
    assert store.discard_staging("models/org/out") == 2
    assert sorted(p.name for p in staging.iterdir()) == ["0123abcd", "models~org~outer.5c6d"]
