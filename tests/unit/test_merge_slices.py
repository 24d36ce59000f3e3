"""Output-slice merges of real tiny checkpoints: partial depth, several slices with their own parameters,
passthrough scale, compute vs output dtype; disk and in-memory merges share the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alloy.merge.executor import execute_merge, merge_state_dicts
from alloy.merge.mergekit import load_recipe_yaml
from kernels.slerp import slerp

torch.set_num_threads(1)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


@pytest.fixture(scope="module")
def five(tiny_model_factory):
    base = tiny_model_factory("llama", seed=0, layers=5)
    return {"A": base, "B": tiny_model_factory("llama", seed=1, base=base, layers=5)}


def merge(text: str, sources, out: Path):
    return execute_merge(load_recipe_yaml(text), sources, out)


def test_partial_depth_slerp_writes_three_layers(five, tmp_path):
    import transformers

    merge(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 3]}, {model: B, layer_range: [0, 3]}]
parameters: {t: 0.4}
""",
        five,
        tmp_path / "out",
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    merged, a, b = (load_weights(p) for p in (tmp_path / "out", five["A"], five["B"]))
    assert not any(".layers.3." in n or ".layers.4." in n for n in merged)
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(merged[name], slerp(a[name], b[name], 0.4))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert model.config.num_hidden_layers == 3


def test_several_slices_with_their_own_parameters(five, tmp_path):
    merge(
        """
merge_method: slerp
base_model: A
slices:
  - sources: [{model: A, layer_range: [0, 2]}, {model: B, layer_range: [0, 2]}]
    parameters: {t: 0.1}
  - sources: [{model: A, layer_range: [2, 5]}, {model: B, layer_range: [2, 5]}]
    parameters: {t: [0.0, 1.0]}
parameters: {t: 0.9}
""",
        five,
        tmp_path / "out",
    )
    merged, a, b = (load_weights(p) for p in (tmp_path / "out", five["A"], five["B"]))
    for layer, t in [(0, 0.1), (1, 0.1), (2, 0.0), (3, 0.5), (4, 1.0)]:
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        assert torch.equal(merged[name], slerp(a[name], b[name], t)), layer
    # outside the layer stack: the first slice's parameters for embeddings, the last slice's (at t = 0) after it
    embed = "model.embed_tokens.weight"
    assert torch.equal(merged[embed], slerp(a[embed], b[embed], 0.1))
    assert torch.equal(merged["lm_head.weight"], slerp(a["lm_head.weight"], b["lm_head.weight"], 0.0))


def test_passthrough_scale_is_applied_at_source_slice_and_global_level(five, tmp_path):
    merge(
        """
merge_method: passthrough
slices:
  - sources: [{model: A, layer_range: [0, 1], parameters: {scale: 0.5}}]
  - sources: [{model: B, layer_range: [4, 5]}]
    parameters: {scale: [{filter: mlp, value: 2.0}]}
parameters: {scale: 3.0}
""",
        five,
        tmp_path / "out",
    )
    merged, a, b = (load_weights(p) for p in (tmp_path / "out", five["A"], five["B"]))
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], a["model.layers.0.mlp.up_proj.weight"] * 0.5)
    assert torch.equal(merged["model.layers.1.mlp.up_proj.weight"], b["model.layers.4.mlp.up_proj.weight"] * 2.0)
    assert torch.equal(
        merged["model.layers.1.self_attn.q_proj.weight"], b["model.layers.4.self_attn.q_proj.weight"] * 3.0
    )
    # embeddings are read with the first slice's source (its scale), the final norm with the last slice's
    assert torch.equal(merged["model.embed_tokens.weight"], a["model.embed_tokens.weight"] * 0.5)
    assert torch.equal(merged["model.norm.weight"], b["model.norm.weight"] * 3.0)


def test_compute_dtype_rounds_inputs_and_output_dtype_is_separate(five, tmp_path):
    merge(
        """
merge_method: linear
models: [{model: A, parameters: {weight: 1.0}}, {model: B, parameters: {weight: 3.0}}]
dtype: bfloat16
out_dtype: float32
""",
        five,
        tmp_path / "out",
    )
    merged, a, b = (load_weights(p) for p in (tmp_path / "out", five["A"], five["B"]))
    name = "model.layers.1.mlp.up_proj.weight"
    assert merged[name].dtype == torch.float32
    expected = ((a[name].bfloat16().float() + 3 * b[name].bfloat16().float()) / 4).bfloat16().float()
    assert torch.equal(merged[name], expected)


def test_disk_and_memory_merges_share_the_sliced_plan(five, tmp_path):
    text = """
merge_method: ties
base_model: A
slices:
  - sources: [{model: A, layer_range: [1, 3]}, {model: B, layer_range: [2, 4], parameters: {weight: 0.7, density: 0.5}}]
"""
    merge(text, five, tmp_path / "out")
    in_memory = merge_state_dicts(load_recipe_yaml(text), {m: load_weights(p) for m, p in five.items()})
    on_disk = load_weights(tmp_path / "out")
    assert on_disk.keys() == in_memory.keys()
    assert all(torch.equal(on_disk[n], in_memory[n]) for n in on_disk)


def test_output_files_keep_the_mergekit_recipe_and_a_card_with_front_matter(five, tmp_path):
    import yaml

    text = "merge_method: slerp\nbase_model: A\nmodels: [{model: A}, {model: B}]\nparameters: {t: 0.5}  # as written\n"
    merge(text, five, tmp_path / "out")
    assert (tmp_path / "out" / "mergekit_config.yml").read_text() == text
    card = (tmp_path / "out" / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == ["A", "B"] and front["tags"] == ["merge", "alloy"]
    assert front["merge_method"] == "slerp"
    assert "# as written" in card


def test_alloy_recipes_write_no_mergekit_config(five, tmp_path):
    from alloy.merge.recipe import MergeRecipe, ModelRef

    execute_merge(
        MergeRecipe(strategy="slerp", models=[ModelRef(model="A"), ModelRef(model="B")]), five, tmp_path / "out"
    )
    assert not (tmp_path / "out" / "mergekit_config.yml").exists()
    assert "merge_method: slerp" in (tmp_path / "out" / "README.md").read_text()
