"""Header-only model inspection: no weights loaded, pickle refused, shards and fingerprints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from alloy.errors import AlloyError, ErrorCode
from alloy.model_manifest import read_manifest


def write_model(folder, tensors, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            config
            or {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 4, "architectures": ["LlamaForCausalLM"]}
        )
    )
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_manifest_reads_headers(tmp_path):
    folder = write_model(tmp_path / "m", {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
    manifest = read_manifest(folder)
    assert manifest.architecture == "LlamaForCausalLM"
    assert manifest.num_layers == 1 and manifest.hidden_size == 4
    assert manifest.parameter_count == 10
    assert manifest.size_bytes == 6 * 4 + 4 * 2
    assert manifest.dtypes == ["BF16", "F32"]
    assert manifest.tensors["a"].shape == [2, 3]


def test_fingerprint_is_structural(tmp_path):
    one = read_manifest(write_model(tmp_path / "one", {"a": torch.zeros(2, 3)}))
    two = read_manifest(write_model(tmp_path / "two", {"a": torch.ones(2, 3)}))
    other = read_manifest(write_model(tmp_path / "three", {"a": torch.ones(3, 2)}))
    assert one.fingerprint == two.fingerprint != other.fingerprint
    assert one.describe_mismatch(other) == {"tensor": "a", "shapes": [[2, 3], [3, 2]]}
    assert one.describe_mismatch(two) is None


def test_sharded_model(tiny_model_factory):
    folder = tiny_model_factory("llama", seed=0, max_shard_size="20KB")
    manifest = read_manifest(folder)
    assert len(manifest.shards) > 1
    assert manifest.model_type == "llama" and manifest.num_layers == 2


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not-read")
    with pytest.raises(AlloyError) as caught:
        read_manifest(folder)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    assert "safetensors only" in caught.value.message


def test_corrupt_header_is_a_validation_error(tmp_path):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(AlloyError) as caught:
        read_manifest(folder)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_index_shard_escaping_the_folder_is_refused(tmp_path):
    folder = write_model(tmp_path / "esc", {"a": torch.zeros(1)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(AlloyError, match="escapes"):
        read_manifest(folder)
