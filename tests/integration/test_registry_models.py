"""ModelRegistry with tiny real Hugging Face models: every test on SQLite and PostgreSQL with a local artifact
store; the storage-facing ones (register, local_dir, shards, artifact sources) also on the moto S3 store."""

from __future__ import annotations

import json
import shutil

import pytest

from alloy.errors import AlloyError, ErrorCode
from alloy.registry.models import ModelRegistry


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama", seed=0)


@pytest.fixture
def registry(database, tiny_llama, tmp_path):
    from alloy.storage.artifacts import ArtifactStore

    return ModelRegistry(
        database, ArtifactStore(tmp_path / "artifacts"), model_roots=[tiny_llama.parent], data_dir=tmp_path / "var"
    )


@pytest.fixture
def any_store_registry(database, artifact_store, tiny_llama, tmp_path):
    """The registry over the local store and over S3."""
    return ModelRegistry(database, artifact_store, model_roots=[tiny_llama.parent], data_dir=tmp_path / "var")


def test_register_reads_config_and_headers(any_store_registry, tiny_llama):
    record = any_store_registry.register("tiny-llama", tiny_llama, owner="alice", lineage={"source": "zoo"})
    config = json.loads((tiny_llama / "config.json").read_text())
    assert record.architecture == "LlamaForCausalLM" and record.model_type == "llama"
    assert record.num_layers == config["num_hidden_layers"] and record.hidden_size == config["hidden_size"]
    assert record.dtypes == ["F32"] and record.shards == ["model.safetensors"]
    manifest = any_store_registry.manifest("tiny-llama")
    assert record.tensor_count == len(manifest.tensors) > 0
    assert record.parameter_count == sum(t.numel for t in manifest.tensors.values())
    assert manifest.tensors["model.embed_tokens.weight"].shape == [config["vocab_size"], config["hidden_size"]]
    assert record.fingerprint == manifest.fingerprint and len(record.fingerprint) == 32
    assert record.artifact_prefix == "models/tiny-llama" and record.owner == "alice"
    assert any_store_registry.get("tiny-llama") == record and any_store_registry.exists("tiny-llama")


def test_local_dir_holds_the_files(any_store_registry, tiny_llama):
    any_store_registry.register("m", tiny_llama)
    local = any_store_registry.local_dir("m")
    assert (local / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    assert (local / "config.json").exists()
    assert any_store_registry.local_dir("m") == local  # cached (S3) or the store folder itself (local)


def test_sharded_model_records_every_shard(any_store_registry, tiny_model_factory):
    sharded = tiny_model_factory("llama", seed=0, max_shard_size="50KB")
    record = any_store_registry.register("sharded", sharded)
    assert len(record.shards) > 1
    assert record.fingerprint == any_store_registry.register("single", tiny_model_factory("llama", seed=0)).fingerprint
    local = any_store_registry.local_dir("sharded")
    assert {p.name for p in local.glob("*.safetensors")} == set(record.shards)
    assert (local / "model.safetensors.index.json").exists()


def test_fingerprint_tells_architectures_apart(registry, tiny_model_factory):
    llama = registry.register("llama", tiny_model_factory("llama", seed=0))
    gpt2 = registry.register("gpt2", tiny_model_factory("gpt2", seed=0))
    tuned = registry.register("llama-tuned", tiny_model_factory("llama", seed=5))
    assert llama.fingerprint == tuned.fingerprint != gpt2.fingerprint
    assert gpt2.model_type == "gpt2" and gpt2.num_layers == 2


def test_pickle_only_folder_is_refused(registry, tiny_llama):
    folder = tiny_llama.parent / "pickled"
    folder.mkdir(exist_ok=True)
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(AlloyError) as caught:
        registry.register("pickled", folder)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED and "safetensors only" in caught.value.message
    assert not registry.exists("pickled") and registry.store.list() == []


def test_pickle_files_next_to_safetensors_are_not_copied(registry, tiny_llama, tmp_path):
    folder = tiny_llama.parent / "mixed"
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    (folder / "training_args.bin").write_bytes(b"pickle")
    registry.register("mixed", folder)
    assert not (registry.local_dir("mixed") / "training_args.bin").exists()


def test_paths_outside_the_roots_are_refused(registry, tiny_llama, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "model"
    shutil.copytree(tiny_llama, outside)
    unknown_home = "~no-such-user-here/model"  # pathlib's expanduser raised RuntimeError for it: a 500
    for source in (outside, str(tiny_llama.parent / ".." / outside.parent.name / "model"), "/etc", unknown_home):
        with pytest.raises(AlloyError) as caught:
            registry.register("outside", source)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
    link = tiny_llama.parent / "sneaky-link"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(AlloyError):
        registry.register("outside", link)


def test_unknown_model_is_model_not_found(registry):
    for call in (registry.get, registry.manifest, registry.local_dir, registry.delete):
        with pytest.raises(AlloyError) as caught:
            call("ghost")
        assert caught.value.code is ErrorCode.MODEL_NOT_FOUND
    assert registry.exists("ghost") is False


def test_duplicate_and_invalid_ids(registry, tiny_llama):
    registry.register("org/model-1.5", tiny_llama)
    with pytest.raises(AlloyError) as caught:
        registry.register("org/model-1.5", tiny_llama)
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    for bad in ("../x", "-lead", "a/b/c", "", "x" * 129, "sp ace", "org"):
        with pytest.raises(AlloyError) as caught:
            registry.register(bad, tiny_llama)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED, bad


def test_list_pages_and_delete(registry, tiny_llama):
    for i in range(5):
        registry.register(f"m{i}", tiny_llama, owner="bob" if i % 2 else None)
    first = registry.list(offset=0, limit=2)
    assert first.total == 5 and [m.id for m in first.items] == ["m0", "m1"]
    assert [m.id for m in registry.list(offset=4, limit=2).items] == ["m4"]
    assert registry.list(owner="bob").total == 2
    registry.delete("m0")
    assert not registry.exists("m0") and not registry.store.exists("models/m0")
    assert registry.list().total == 4
    registry.register("m0", tiny_llama)  # the id is free again


def test_register_an_artifact_folder_in_place(any_store_registry, tiny_llama):
    any_store_registry.store.put_dir("outputs/job-1", tiny_llama)
    for source in (any_store_registry.store.uri_for("outputs/job-1"),):
        record = any_store_registry.register("merged", source, lineage={"job_id": "job-1"})
    assert record.artifact_prefix == "outputs/job-1" and record.lineage == {"job_id": "job-1"}
    assert (any_store_registry.local_dir("merged") / "model.safetensors").exists()
    with pytest.raises(AlloyError) as caught:
        any_store_registry.register("half", any_store_registry.store.uri_for("outputs/missing"))
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_register_in_place_without_copying(database, tmp_path, tiny_llama):
    from alloy.storage.artifacts import ArtifactStore

    registry = ModelRegistry(
        database, ArtifactStore(tmp_path / "artifacts"), model_roots=[tiny_llama.parent], data_dir=tmp_path / "var"
    )
    record = registry.register("in-place", tiny_llama, copy_into_store=False)
    assert record.artifact_prefix is None and registry.local_dir("in-place") == tiny_llama.resolve()
    registry.delete("in-place")
    assert (tiny_llama / "model.safetensors").exists()
