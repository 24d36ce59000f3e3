"""ArtifactStore on a local folder and on a real S3-protocol server (moto), plus the artifacts catalog."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.artifact_catalog import ArtifactCatalog
from alloy.storage.artifacts import ArtifactStore

BLOB = bytes(range(256)) * 4096  # 1 MiB


def chunked(data: bytes, size: int = 100_000):
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_streamed_put_and_get_record_size_and_sha256(artifact_store):
    info = artifact_store.put_stream("outputs/blob.bin", chunked(BLOB))
    assert info.size == len(BLOB) and info.sha256 == hashlib.sha256(BLOB).hexdigest()
    assert info.uri == f"{artifact_store.uri}/outputs/blob.bin"
    assert artifact_store.exists("outputs/blob.bin")
    assert b"".join(artifact_store.iter_bytes("outputs/blob.bin", 65536)) == BLOB
    with artifact_store.open("outputs/blob.bin") as handle:
        assert handle.read(4) == BLOB[:4]
    assert artifact_store.info("outputs/blob.bin").size == len(BLOB)


def test_put_file_replaces_and_delete(artifact_store, tmp_path):
    source = tmp_path / "a.txt"
    source.write_bytes(b"first")
    artifact_store.put_file("a.txt", source)
    artifact_store.put_bytes("a.txt", b"second")
    assert artifact_store.read_bytes("a.txt") == b"second"
    assert artifact_store.delete("a.txt") is True
    assert artifact_store.delete("a.txt") is False
    assert not artifact_store.exists("a.txt")
    with pytest.raises(AlloyError) as caught:
        artifact_store.open("a.txt")
    assert caught.value.code is ErrorCode.NOT_FOUND


def test_list_and_delete_prefix(artifact_store):
    for key in ("runs/1/a", "runs/1/b", "runs/2/a", "other"):
        artifact_store.put_bytes(key, key.encode())
    assert [i.key for i in artifact_store.list("runs")] == ["runs/1/a", "runs/1/b", "runs/2/a"]
    assert [i.key for i in artifact_store.list("runs/1/")] == ["runs/1/a", "runs/1/b"]
    assert [i.key for i in artifact_store.list()] == ["other", "runs/1/a", "runs/1/b", "runs/2/a"]
    assert artifact_store.list("absent") == []
    assert artifact_store.delete_prefix("runs/1") == 2
    assert [i.key for i in artifact_store.list()] == ["other", "runs/2/a"]


@pytest.mark.parametrize(
    "key", ["../escape", "/abs/path", "a/../../b", "a//b", "", ".staging/x", "a\\b", "x/.alloy-dir.json"]
)
def test_keys_are_confined(artifact_store, key):
    with pytest.raises(AlloyError) as caught:
        artifact_store.put_bytes(key, b"x")
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def _folder(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "weights.safetensors").write_bytes(BLOB)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


def test_put_dir_and_get_dir_round_trip(artifact_store, tmp_path):
    infos = artifact_store.put_dir("models/m1", _folder(tmp_path))
    assert [i.key for i in infos] == [
        "models/m1/config.json",
        "models/m1/sub/tokenizer.json",
        "models/m1/weights.safetensors",
    ]
    assert infos[2].sha256 == hashlib.sha256(BLOB).hexdigest()
    assert artifact_store.dir_exists("models/m1") and artifact_store.exists("models/m1")
    listed = artifact_store.list("models/m1")
    assert [(i.key, i.sha256) for i in listed] == [(i.key, i.sha256) for i in infos]
    out = artifact_store.get_dir("models/m1", tmp_path / "copy")
    assert (out / "weights.safetensors").read_bytes() == BLOB
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "sub", "weights.safetensors"]
    with pytest.raises(AlloyError) as caught:
        artifact_store.put_dir("models/m1", _folder(tmp_path))
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    artifact_store.put_dir("models/m1", _folder(tmp_path), files=["config.json"], overwrite=True)
    assert [i.key for i in artifact_store.list("models/m1")] == ["models/m1/config.json"]


class CrashingStore(ArtifactStore):
    """Fails on the n-th file write, as a writer dying mid-upload would."""

    def __init__(self, *args, crash_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes_left = crash_after

    def _write(self, path, chunks):
        if self.writes_left == 0:
            raise ConnectionError("simulated crash mid-upload")
        self.writes_left -= 1
        return super()._write(path, chunks)


def _same_place(store: ArtifactStore, crash_after: int) -> CrashingStore:
    return CrashingStore(store.uri, dict(store.fs.storage_options), crash_after=crash_after)


def test_crash_mid_put_dir_leaves_nothing_visible(artifact_store, tmp_path):
    crashing = _same_place(artifact_store, crash_after=2)
    with pytest.raises(ConnectionError):
        crashing.put_dir("models/broken", _folder(tmp_path))
    assert not artifact_store.exists("models/broken")
    assert artifact_store.list() == []
    with pytest.raises(AlloyError):
        artifact_store.get_dir("models/broken", tmp_path / "out")
    artifact_store.put_dir("models/broken", _folder(tmp_path))  # the name is still free
    assert artifact_store.dir_exists("models/broken")


def test_crash_mid_stream_leaves_nothing_visible(artifact_store):
    def dying():
        yield b"x" * 1000
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        artifact_store.put_stream("half.bin", dying())
    assert not artifact_store.exists("half.bin") and artifact_store.list() == []


def test_s3_crash_while_publishing_hides_the_half_copied_folder(s3_server, tmp_path, monkeypatch):
    store = ArtifactStore(s3_server.new_uri(), s3_server.storage_options)
    real_copy, copies = store.fs.copy, []

    def copy_then_die(source, target, **kwargs):
        if copies:
            raise ConnectionError("simulated crash during publish")
        copies.append(target)
        return real_copy(source, target, **kwargs)

    monkeypatch.setattr(store.fs, "copy", copy_then_die)  # fsspec shares fs instances: undo after the test
    with pytest.raises(ConnectionError):
        store.put_dir("models/half", _folder(tmp_path))
    assert copies  # one file really reached its final key ...
    fresh = ArtifactStore(store.uri, s3_server.storage_options)
    assert fresh.list() == [] and not fresh.exists("models/half")  # ... and is still invisible
    assert not fresh.exists(copies[0].split(store.uri.removeprefix("s3://") + "/")[1])


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_killed_writer_process_leaves_nothing_visible(backend, tmp_path, request):
    if backend == "local":
        uri, options = str(tmp_path / "artifacts"), {}
    else:
        server = request.getfixturevalue("s3_server")
        uri, options = server.new_uri(), server.storage_options
    script = textwrap.dedent(f"""
        import os
        from alloy.storage.artifacts import ArtifactStore
        store = ArtifactStore({uri!r}, {options!r})
        def chunks():
            yield b"x" * 1_000_000
            os._exit(9)  # the process dies mid-upload: no cleanup runs
        store.put_stream("victim.bin", chunks())
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 9
    store = ArtifactStore(uri, options)
    assert not store.exists("victim.bin") and store.list() == []
    assert store.gc_staging(older_than_s=0) >= (1 if backend == "local" else 0)


def test_key_for_recognises_uris_inside_the_store(artifact_store):
    assert artifact_store.key_for(f"{artifact_store.uri}/models/x") == "models/x"
    assert artifact_store.key_for("/somewhere/else") is None


def test_from_settings_uses_the_configured_s3_endpoint(s3_server, monkeypatch):
    from alloy.config import Settings

    settings = Settings(
        artifacts={
            "uri": s3_server.new_uri(),
            "s3": {
                "endpoint_url": s3_server.endpoint_url,
                "region": "us-east-1",
                "access_key_id": "alloy-test-key",
                "secret_access_key": "alloy-test-secret",
            },
        }
    )
    store = ArtifactStore.from_settings(settings)
    store.put_bytes("hello", b"world")
    assert store.read_bytes("hello") == b"world"


def test_catalog_records_artifacts(database, artifact_store, tmp_path):
    catalog = ArtifactCatalog(database, artifact_store)
    infos = artifact_store.put_dir("models/m", _folder(tmp_path))
    catalog.record(infos, kind="model", owner="alice")
    catalog.record(artifact_store.put_bytes("outputs/o", b"o"), kind="merge-output")
    record = catalog.get("models/m/weights.safetensors")
    assert record.sha256 == hashlib.sha256(BLOB).hexdigest() and record.size == len(BLOB)
    assert record.kind == "model" and record.owner == "alice" and record.created_at.tzinfo is not None
    assert catalog.list("models/m").total == 3 and catalog.list(kind="merge-output").total == 1
    catalog.delete("outputs/o")
    assert not artifact_store.exists("outputs/o")
    assert catalog.forget_prefix("models/m") == 3 and catalog.list().total == 0
    with pytest.raises(AlloyError):
        catalog.get("outputs/o")
