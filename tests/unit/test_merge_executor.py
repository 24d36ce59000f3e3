"""End-to-end merges of tiny random models through the streaming executor."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.executor import MergeCancelled, check_compatibility, execute_merge, merge_state_dicts
from alloy.merge.recipe import MergeRecipe, ModelRef, Slice
from alloy.model_manifest import read_manifest

torch.set_num_threads(1)


def recipe(strategy: str, ids: list[str], **kwargs) -> MergeRecipe:
    return MergeRecipe(strategy=strategy, models=[ModelRef(model=m) for m in ids], **kwargs)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def assert_loads_with_finite_logits(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert torch.isfinite(logits).all()
    return model


@pytest.fixture(scope="module")
def family(tiny_family):
    base, tunes = tiny_family
    return {"base": base, "t1": tunes[0], "t2": tunes[1], "t3": tunes[2]}


@pytest.mark.parametrize(
    "strategy, ids, parameters",
    [
        ("ties", ["base", "t1", "t2", "t3"], {"density": 0.5}),
        ("dare", ["base", "t1", "t2"], {"drop_rate": 0.3, "consensus": True}),
        ("slerp", ["base", "t1"], {"t": [0.0, 1.0]}),
        ("task_arithmetic", ["base", "t1", "t2"], {"lambda": 0.8}),
        ("task_arithmetic:linear", ["t1", "t2"], {}),
    ],
)
def test_llama_merges_load_and_give_finite_logits(family, tmp_path, strategy, ids, parameters):
    strategy, _, variant = strategy.partition(":")
    result = execute_merge(
        recipe(strategy, ids, parameters=parameters, seed=1, variant=variant or None), family, tmp_path / "out"
    )
    assert result.tensors == len(read_manifest(family["base"]).tensors)
    assert (tmp_path / "out" / "README.md").read_text().count(f"merge_strategy: {strategy}\n") == 1
    assert_loads_with_finite_logits(tmp_path / "out")


@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_other_architectures_merge(tiny_model_factory, tmp_path, arch):
    base = tiny_model_factory(arch, seed=0)
    tune = tiny_model_factory(arch, seed=1, base=base)
    execute_merge(recipe("ties", ["b", "t"], parameters={"density": 0.7}), {"b": base, "t": tune}, tmp_path / "out")
    assert_loads_with_finite_logits(tmp_path / "out")


def test_merged_values_match_hand_computed_task_arithmetic(family, tmp_path):
    execute_merge(
        recipe("task_arithmetic", ["base", "t1", "t2"], parameters={"lambda": 0.5}, dtype="float32"),
        family,
        tmp_path / "out",
    )
    base, t1, t2 = (load_weights(family[m]) for m in ("base", "t1", "t2"))
    merged = load_weights(tmp_path / "out")
    name = "model.layers.1.mlp.up_proj.weight"
    expected = base[name] + 0.5 * ((t1[name] - base[name]) + (t2[name] - base[name]))
    assert torch.allclose(merged[name], expected, atol=1e-6)


@pytest.mark.parametrize("arch, layer_key", [("llama", "num_hidden_layers"), ("gpt2", "n_layer")])
def test_franken_merge_stacks_slices(tiny_model_factory, tmp_path, arch, layer_key):
    a = tiny_model_factory(arch, seed=0, layers=3)
    b = tiny_model_factory(arch, seed=1, base=a, layers=3)
    slices = [
        Slice(model="a", layer_range=(0, 2)),
        Slice(model="b", layer_range=(1, 3)),
        Slice(model="a", layer_range=(1, 2)),
    ]
    result = execute_merge(MergeRecipe(strategy="franken_merge", slices=slices), {"a": a, "b": b}, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config[layer_key] == 5
    model = assert_loads_with_finite_logits(tmp_path / "out")
    assert model.config.num_hidden_layers == 5
    merged, source_a, source_b = load_weights(tmp_path / "out"), load_weights(a), load_weights(b)
    prefix = "model.layers" if arch == "llama" else "transformer.h"
    norm = "input_layernorm.weight" if arch == "llama" else "ln_1.weight"
    # output layer 2 is b's layer 1; output layer 4 repeats a's layer 1 as its own tensor
    assert torch.equal(merged[f"{prefix}.2.{norm}"], source_b[f"{prefix}.1.{norm}"])
    assert torch.equal(merged[f"{prefix}.4.{norm}"], source_a[f"{prefix}.1.{norm}"])
    per_layer = sum(1 for n in source_a if n.startswith(f"{prefix}.0."))
    assert result.tensors == len(source_a) - 3 * per_layer + 5 * per_layer


def test_franken_slice_outside_the_model_is_refused(family, tmp_path):
    slices = [Slice(model="base", layer_range=(0, 3))]  # the tiny llama has 2 layers
    with pytest.raises(AlloyError) as info:
        execute_merge(MergeRecipe(strategy="franken_merge", slices=slices), family, tmp_path / "out")
    assert info.value.details["parameter"] == "slices"
    assert not (tmp_path / "out").exists()


def test_incompatible_shapes_name_the_first_tensor(tiny_model_factory, family, tmp_path):
    wide = tiny_model_factory("llama", seed=5, hidden=64)
    with pytest.raises(AlloyError) as info:
        execute_merge(recipe("ties", ["base", "wide"]), {**family, "wide": wide}, tmp_path / "out")
    assert info.value.code is ErrorCode.INCOMPATIBLE_MODELS
    assert info.value.details["tensor"] == "lm_head.weight"
    assert info.value.details["shapes"] == [[128, 32], [128, 64]]
    assert not list(tmp_path.iterdir())  # nothing written, no staging left


def test_incompatible_architectures(tiny_model_factory, family):
    gpt2 = tiny_model_factory("gpt2", seed=0)
    manifests = {"base": read_manifest(family["base"]), "g": read_manifest(gpt2)}
    with pytest.raises(AlloyError) as info:
        check_compatibility(recipe("task_arithmetic", ["base", "g"]), manifests)
    assert info.value.code is ErrorCode.INCOMPATIBLE_MODELS
    assert info.value.details["architectures"] == ["llama", "gpt2"]


def test_franken_needs_one_hidden_size(tiny_model_factory, family):
    wide = tiny_model_factory("llama", seed=5, hidden=64)
    slices = [Slice(model="base", layer_range=(0, 1)), Slice(model="wide", layer_range=(0, 1))]
    manifests = {"base": read_manifest(family["base"]), "wide": read_manifest(wide)}
    with pytest.raises(AlloyError) as info:
        check_compatibility(MergeRecipe(strategy="franken_merge", slices=slices), manifests)
    assert info.value.details["hidden_sizes"] == [32, 64]


def test_same_seed_same_bits_whatever_threads_and_order(family, tmp_path):
    dare_recipe = recipe("dare", ["base", "t1", "t2"], parameters={"drop_rate": 0.5}, seed=42)
    execute_merge(dare_recipe, family, tmp_path / "serial", workers=1, max_in_flight=1)
    torch.set_num_threads(2)
    try:
        execute_merge(dare_recipe, family, tmp_path / "parallel", workers=4, max_in_flight=8)
    finally:
        torch.set_num_threads(1)
    execute_merge(dare_recipe.model_copy(update={"seed": 43}), family, tmp_path / "other")
    serial, parallel, other = (load_weights(tmp_path / d) for d in ("serial", "parallel", "other"))
    assert all(torch.equal(serial[n], parallel[n]) for n in serial)
    assert any(not torch.equal(serial[n], other[n]) for n in serial)


def test_sharded_inputs_and_outputs_match_the_in_memory_merge(tiny_model_factory, family, tmp_path):
    sharded = tiny_model_factory("llama", seed=1, base=family["base"], max_shard_size="20KB")
    assert len(read_manifest(sharded).shards) > 1
    sources = {"base": family["base"], "s": sharded, "t2": family["t2"]}
    ties_recipe = recipe(
        "ties", ["base", "s", "t2"], parameters={"density": 0.4, "epsilon": 0.1}, seed=3, dtype="bfloat16"
    )
    execute_merge(ties_recipe, sources, tmp_path / "out", shard_bytes=16_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    on_disk = load_weights(tmp_path / "out")
    in_memory = merge_state_dicts(ties_recipe, {m: load_weights(p) for m, p in sources.items()})
    assert set(on_disk) == set(in_memory) == set(index["weight_map"])
    assert all(on_disk[n].dtype == torch.bfloat16 and torch.equal(on_disk[n], in_memory[n]) for n in on_disk)


def test_merge_state_dicts_does_not_touch_its_inputs(family):
    state_dicts = {m: load_weights(family[m]) for m in ("base", "t1")}
    copies = {m: {n: t.clone() for n, t in sd.items()} for m, sd in state_dicts.items()}
    merge_state_dicts(recipe("ties", ["base", "t1"]), state_dicts)
    assert all(torch.equal(state_dicts[m][n], copies[m][n]) for m in copies for n in copies[m])


def test_progress_is_reported_per_tensor(family, tmp_path):
    seen = []
    result = execute_merge(
        recipe("task_arithmetic", ["t1", "t2"], variant="linear"), family, tmp_path / "out", progress=seen.append
    )
    assert [p.tensors_done for p in seen] == list(range(1, result.tensors + 1))
    assert seen[-1].bytes_done == seen[-1].bytes_total == result.bytes
    assert all(p.current for p in seen)


def test_cancel_leaves_nothing(family, tmp_path):
    cancel = threading.Event()

    def cancel_after_three(progress):
        if progress.tensors_done == 3:
            cancel.set()

    with pytest.raises(MergeCancelled):
        execute_merge(
            recipe("ties", ["base", "t1"]),
            family,
            tmp_path / "out",
            progress=cancel_after_three,
            cancel=cancel,
            max_in_flight=1,
            workers=1,
        )
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(family, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(AlloyError) as info:
        execute_merge(recipe("task_arithmetic", ["t1", "t2"], variant="linear"), family, tmp_path / "out")
    assert info.value.code is ErrorCode.ALREADY_EXISTS


def test_cli_merges_a_mergekit_recipe(family, tmp_path):
    from click.testing import CliRunner

    from alloy.cli.merge import merge

    recipe_file = tmp_path / "recipe.yml"
    recipe_file.write_text(f"""
merge_method: dare_linear
base_model: {family["base"]}
models:
  - model: {family["t1"]}
    parameters: {{weight: 0.5, density: 0.7}}
  - model: {family["t2"]}
    parameters: {{weight: 0.5, density: 0.7}}
dtype: float16
""")
    outcome = CliRunner().invoke(merge, [str(recipe_file), str(tmp_path / "out"), "--seed", "5", "--quiet"])
    assert outcome.exit_code == 0, outcome.output
    assert "merged" in outcome.output
    assert all(t.dtype == torch.float16 for t in load_weights(tmp_path / "out").values())
    missing = CliRunner().invoke(merge, [str(recipe_file), str(tmp_path / "out")])
    assert missing.exit_code != 0 and "ALREADY_EXISTS" in missing.output


def test_cli_names_each_parameter_the_method_does_not_read_in_a_warning(family, tmp_path):
    from click.testing import CliRunner

    from alloy.cli.merge import merge

    recipe_file = tmp_path / "recipe.yml"
    recipe_file.write_text(f"""
merge_method: slerp
base_model: {family["base"]}
models:
  - model: {family["base"]}
  - model: {family["t1"]}
    parameters: {{weight: 0.4}}
parameters: {{t: 0.3, density: 0.5}}
""")
    outcome = CliRunner().invoke(merge, [str(recipe_file), str(tmp_path / "out"), "--quiet"])
    assert outcome.exit_code == 0, outcome.output
    assert "Warning: parameters.density: not read by slerp" in outcome.output
    assert "Warning: models.1.parameters.weight: not read by slerp" in outcome.output
    recipe_file.write_text(recipe_file.read_text().replace("density", "densty"))
    refused = CliRunner().invoke(merge, [str(recipe_file), str(tmp_path / "out2"), "--quiet"])
    assert refused.exit_code != 0 and "VALIDATION_FAILED" in refused.output and "parameters.densty" in refused.output


def test_the_longest_tensors_start_first_and_the_output_is_the_plans(family, tmp_path):
    """One merge thread: the progress events come in the order tasks start, the largest merged tensors first
    (the embeddings, last in a Llama plan), copied ones last; the files are those of a plan-order merge."""
    from alloy.merge.executor import prepare
    from alloy.merge.footprint import execution_order, task_numel

    ties = recipe("ties", ["base", "t1", "t2"], parameters={"density": 0.5})
    plan = prepare(ties, {m: read_manifest(family[m]) for m in ties.model_ids})
    seen = []
    execute_merge(ties, family, tmp_path / "one", progress=seen.append, workers=1, max_in_flight=1)
    started = [p.current for p in seen]
    assert started == [t.output_name for t in execution_order(plan.tasks)] != [t.output_name for t in plan.tasks]
    sizes = [task_numel(t) * len(t.sources) if t.compute else 0 for t in execution_order(plan.tasks)]
    assert sizes == sorted(sizes, reverse=True)
    execute_merge(ties, family, tmp_path / "two")  # two threads, finishing in any order
    one, two = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    assert one.keys() == two.keys() and all(torch.equal(one[n], two[n]) for n in one)


def test_a_task_over_the_budget_takes_every_merge_threads_cores_and_gives_the_same_bytes(family, tmp_path, monkeypatch):
    """With a 1-byte budget every task runs alone: on two cores it runs with two intra-op threads, reads and
    writes on threads (its output written in two pieces), and the files are those of a one-thread merge; the
    caller's thread count is restored."""
    import alloy.merge.executor as executor

    ties = recipe("ties", ["base", "t1", "t2"], parameters={"density": 0.5})
    execute_merge(ties, family, tmp_path / "one", workers=1, max_in_flight=1)
    monkeypatch.setattr(executor, "usable_cores", lambda: 2)
    threads_seen = []
    compute = executor.compute_tensor

    def recording(*args, **kwargs):
        threads_seen.append(torch.get_num_threads())
        return compute(*args, **kwargs)

    monkeypatch.setattr(executor, "compute_tensor", recording)
    pieces = []
    write_range = executor.ShardedWriter.write_range
    monkeypatch.setattr(
        executor.ShardedWriter,
        "write_range",
        lambda self, name, start, piece: pieces.append(name) or write_range(self, name, start, piece),
    )
    before = torch.get_num_threads()
    execute_merge(ties, family, tmp_path / "alone", workers=2, max_in_flight_bytes=1)
    assert torch.get_num_threads() == before == 1
    assert threads_seen and set(threads_seen) == {2}
    computed = [t for t in load_weights(tmp_path / "one") if t in set(pieces)]
    assert computed and all(pieces.count(name) == 2 for name in computed)
    one, alone = load_weights(tmp_path / "one"), load_weights(tmp_path / "alone")
    assert one.keys() == alone.keys() and all(torch.equal(one[n], alone[n]) for n in one)
    threads_seen.clear()
    execute_merge(ties, family, tmp_path / "budget")  # the default budget holds every tiny tensor: none alone
    assert set(threads_seen) == {1}
