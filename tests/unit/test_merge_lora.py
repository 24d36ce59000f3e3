"""LoRA inputs (``base+adapter`` in a mergekit recipe): the adapter is folded in per tensor, W + s * B @ A, before
the merge; pickled, missing or mis-shaped adapters are refused by name before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.executor import execute_merge
from alloy.merge.lora import LoraSource
from alloy.merge.mergekit import load_recipe_yaml

torch.set_num_threads(1)

TARGETS = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj")
RANK = 4
ALPHA = 8.0


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    base = tiny_model_factory("llama", seed=0)
    return base, tiny_model_factory("llama", seed=1, base=base)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def write_adapter(
    folder: Path,
    base: dict[str, torch.Tensor],
    *,
    rslora: bool = False,
    fan_in_fan_out: bool = False,
    seed: int = 0,
    **config,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT-layout LoRA adapter for TARGETS (plain safetensors, PEFT's tensor names); returns module -> (A, B)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for module in TARGETS:
        out_features, in_features = base[f"{module}.weight"].shape
        if fan_in_fan_out:  # the base weight is stored [in, out] (GPT-2's Conv1D)
            in_features, out_features = base[f"{module}.weight"].shape
        a = torch.randn(RANK, in_features, generator=g)
        b = torch.randn(out_features, RANK, generator=g)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        pairs[module] = (a, b)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": RANK,
                "lora_alpha": ALPHA,
                "target_modules": ["q_proj", "up_proj"],
                "use_rslora": rslora,
                "fan_in_fan_out": fan_in_fan_out,
                **config,
            }
        )
    )
    return pairs


LINEAR = """
merge_method: linear
models:
  - model: base+lora
    parameters: {weight: 0.5}
  - model: other
    parameters: {weight: 0.5}
dtype: float32
"""


def merge(base: Path, other: Path, adapter: Path, out: Path, text: str = LINEAR):
    sources = {"base+lora": LoraSource(base, adapter), "other": other}
    return execute_merge(load_recipe_yaml(text), sources, out)


@pytest.mark.parametrize(("rslora", "fan_in_fan_out"), [(False, False), (True, False), (False, True)])
def test_merged_result_is_base_plus_scaled_b_at_a(pair, tmp_path, rslora, fan_in_fan_out):
    base, other = pair
    w, o = weights(base), weights(other)
    # fan_in_fan_out: the adapter reads the stored [64, 32] up_proj as [in, out], so B @ A is [32, 64], transposed
    pairs = write_adapter(tmp_path / "lora", w, rslora=rslora, fan_in_fan_out=fan_in_fan_out)
    merge(base, other, tmp_path / "lora", tmp_path / "out")
    merged = weights(tmp_path / "out")
    scale = ALPHA / (math.sqrt(RANK) if rslora else RANK)
    for module, (a, b) in pairs.items():
        name = f"{module}.weight"
        delta = (b @ a).T if fan_in_fan_out else b @ a
        expected = 0.5 * (w[name] + scale * delta) + 0.5 * o[name]
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged[name], 0.5 * (w[name] + o[name]), atol=1e-3)  # the adapter did something
    untouched = "model.layers.0.self_attn.k_proj.weight"
    torch.testing.assert_close(merged[untouched], 0.5 * (w[untouched] + o[untouched]), rtol=1e-6, atol=1e-6)


def refusal(pair, tmp_path, adapter: Path, code: ErrorCode = ErrorCode.VALIDATION_FAILED) -> AlloyError:
    base, other = pair
    with pytest.raises(AlloyError) as info:
        merge(base, other, adapter, tmp_path / "out")
    assert info.value.code == code
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.staging") for p in tmp_path.iterdir())  # nothing half-written
    assert str(tmp_path) not in info.value.message  # no server path in a client error
    return info.value


def test_pickled_adapter_is_refused_never_loaded(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]))
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(b"not even a pickle")
    error = refusal(pair, tmp_path, adapter)
    assert error.details["file"] == "adapter_model.bin" and "pickle" in error.message


def test_missing_adapter_files_are_refused_by_name(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]))
    (adapter / "adapter_model.safetensors").unlink()
    assert refusal(pair, tmp_path, adapter).details["file"] == "adapter_model.safetensors"
    (adapter / "adapter_config.json").unlink()
    assert refusal(pair, tmp_path, adapter).details["file"] == "adapter_config.json"


def test_shape_mismatch_is_refused_naming_the_tensor(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]))
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = f"base_model.model.{TARGETS[1]}.lora_B.weight"
    tensors[name] = tensors[name][:-1]  # one output row short of the base tensor
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    error = refusal(pair, tmp_path, adapter, ErrorCode.INCOMPATIBLE_MODELS)  # the adapter does not fit this base
    assert error.details["tensor"] == f"{TARGETS[1]}.weight"


def test_integer_or_empty_adapter_weights_are_refused(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]))
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = f"base_model.model.{TARGETS[0]}.lora_A.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    assert refusal(pair, tmp_path, adapter).details["tensor"] == f"{TARGETS[0]}.weight"
    save_file({}, str(adapter / "adapter_model.safetensors"))
    assert refusal(pair, tmp_path, adapter).details["file"] == "adapter_model.safetensors"


def test_rank_other_than_the_config_r_is_refused(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]), r=RANK + 1)
    assert refusal(pair, tmp_path, adapter).details["tensor"] == f"{TARGETS[0]}.weight"


def test_target_the_base_lacks_and_unsupported_settings_are_refused(pair, tmp_path):
    adapter = tmp_path / "lora"
    write_adapter(adapter, weights(pair[0]))
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    refused = refusal(pair, tmp_path, adapter, ErrorCode.INCOMPATIBLE_MODELS)
    assert refused.details["tensor"] == f"{TARGETS[1].replace('1', '7')}.weight"
    dora = tmp_path / "dora"
    write_adapter(dora, weights(pair[0]), use_dora=True)
    assert "use_dora" in refusal(pair, tmp_path, dora).message


def test_malformed_references_are_refused_by_field():
    with pytest.raises(AlloyError) as info:
        load_recipe_yaml("merge_method: linear\nmodels: [{model: a+b+c}, {model: d}]\n")
    assert info.value.code == ErrorCode.VALIDATION_FAILED and info.value.details["field"] == "models.0.model"
    with pytest.raises(AlloyError):
        load_recipe_yaml("merge_method: linear\nmodels: [{model: a+}, {model: d}]\n")
    recipe = load_recipe_yaml("merge_method: linear\nmodels: [{model: a+b, parameters: {weight: 1}}, {model: d}]\n")
    assert recipe.model_ids[0] == "a+b"


def test_lora_reference_needs_a_lora_source(pair, tmp_path):
    base, other = pair
    with pytest.raises(AlloyError) as info:
        execute_merge(load_recipe_yaml(LINEAR), {"base+lora": base, "other": other}, tmp_path / "out")
    assert info.value.code == ErrorCode.VALIDATION_FAILED and info.value.details["model"] == "base+lora"


def test_alloy_merge_cli_reads_model_plus_adapter(pair, tmp_path):
    from click.testing import CliRunner

    from alloy.cli.merge import merge as merge_command

    base, other = pair
    w, o = weights(base), weights(other)
    (a, b) = write_adapter(tmp_path / "lora", w)[TARGETS[0]]
    recipe = tmp_path / "recipe.yml"
    # "lora" is relative to the recipe's folder, as model paths may be
    recipe.write_text(LINEAR.replace("base+lora", f"{base}+lora").replace("model: other", f"model: {other}"))
    result = CliRunner().invoke(merge_command, [str(recipe), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    name = f"{TARGETS[0]}.weight"
    expected = 0.5 * (w[name] + ALPHA / RANK * (b @ a)) + 0.5 * o[name]
    torch.testing.assert_close(weights(tmp_path / "out")[name], expected, rtol=1e-5, atol=1e-5)
    (tmp_path / "lora" / "adapter_model.safetensors").unlink()
    refused = CliRunner().invoke(merge_command, [str(recipe), str(tmp_path / "out3"), "--quiet"])
    assert refused.exit_code != 0 and "VALIDATION_FAILED" in refused.output and "adapter_model" in refused.output
