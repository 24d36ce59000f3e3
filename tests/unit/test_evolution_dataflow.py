"""The data-flow (DFS) genome: a layer path of T = repeats x layers steps (a source's layer or a skip, and a scale)
decoded to a franken ``slices`` recipe; its in-memory merge equals the hand-built layer stack; PS+DFS (a PS merge
as one more source); one seed, one population."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alloy.merge.executor import merge_state_dicts
from alloy.merge.recipe import MergeRecipe, validate_recipe
from evolution.config import parse_spec
from evolution.dataflow import DataFlowGenome, Step, decode_path, encode_path
from evolution.genome import GenomeSpace
from evolution.inputs import ResolvedInputs, genome_space

torch.set_num_threads(1)

LAYERS = 3


def space(models=("a", "b"), base="base", repeats=2, **flow) -> GenomeSpace:
    return GenomeSpace(
        strategy="franken_merge",
        models=list(models),
        base_model=base,
        dataflow=DataFlowGenome(num_layers=LAYERS, repeats=repeats, **flow),
    )


def scaled(value: float) -> list[dict]:
    return [{"filter": "o_proj", "value": value}, {"filter": "down_proj", "value": value}, {"value": 1.0}]


def piece(model: str, start: int, end: int, scale: float) -> dict:
    return {"sources": [{"model": model, "layer_range": [start, end]}], "parameters": {"scale": scaled(scale)}}


# A path over T = 2 x 3 steps: skips, a repeated layer, a run of one source at one scale that merges into a slice.
PATH = [
    Step(source="a", layer=0, scale=1.25),
    Step(source="a", layer=1, scale=1.25),
    Step(source=None, layer=2, scale=1.0),
    Step(source="base", layer=0, scale=0.5),
    Step(source=None, layer=1, scale=1.0),
    Step(source="b", layer=2, scale=0.75),
]


def test_the_genome_has_two_genes_per_step_and_the_initial_path_is_the_base_model():
    s = space()
    names = [g.name for g in s.genes()]
    assert len(names) == 2 * 2 * LAYERS and names[:2] == ["step.0.source", "step.0.scale"]
    assert s.genes()[0].choices == ["skip", "a", "b", "base"]
    assert s.decode_dict(s.initial()) == {"strategy": "franken_merge", "slices": [piece("base", 0, LAYERS, 1.0)]}


def test_a_path_round_trips_through_its_genome_to_a_valid_recipe():
    s = space()
    flow, sources = s.dataflow, s.dataflow_sources()
    assert flow is not None
    genome = encode_path(flow, sources, PATH)
    assert decode_path(flow, sources, genome) == PATH
    recipe = s.decode_dict(genome)
    assert recipe["slices"] == [piece("a", 0, 2, 1.25), piece("base", 0, 1, 0.5), piece("b", 2, 3, 0.75)]
    validated = validate_recipe(MergeRecipe.model_validate(recipe))
    assert [m.model for m in validated.models] == ["a", "base", "b"]


def test_scales_are_clipped_to_their_bounds_and_an_all_skip_path_still_decodes():
    s = space(scale=[0.5, 2.0, 1.0])
    flow, sources = s.dataflow, s.dataflow_sources()
    assert flow is not None
    genome = encode_path(flow, sources, [Step(source="b", layer=t % LAYERS, scale=1.0) for t in range(6)])
    genome["step.0.scale"], genome["step.1.scale"] = 9.0, -3.0  # a searcher stepping outside
    steps = decode_path(flow, sources, s.validate_genome(genome))
    assert [step.scale for step in steps[:3]] == [2.0, 0.5, 1.0]
    skipped = {name: (0.5 if name.endswith("source") else 1.0) for name in genome}
    assert s.decode_dict(skipped)["slices"] == [piece("a", 0, 1, 1.0)]


def test_a_bad_dataflow_space_is_refused():
    with pytest.raises(ValueError, match="franken_merge"):
        GenomeSpace(strategy="task_arithmetic", models=["a"], dataflow=DataFlowGenome(num_layers=2))
    with pytest.raises(ValueError, match="no other genes"):
        GenomeSpace(
            strategy="franken_merge",
            models=["a"],
            per_model={"scale": [0.5, 1.5]},
            dataflow=DataFlowGenome(num_layers=2),
        )
    with pytest.raises(ValueError, match="init_source"):
        space(init_source="nobody")


def test_one_seed_gives_one_population_and_one_step():
    s = space()
    first, again, other = s.population(6, seed=3, spread=0.2), s.population(6, seed=3, spread=0.2), s.population(6, 4)
    assert first == again and first != other
    keys = [s.decode_dict(g) for g in first]
    assert len({str(k) for k in keys}) > 1  # the neighbours are other paths, not copies of the initial one
    step = s.perturb(first[1], random.Random(7), sigma=0.3)
    assert step == s.perturb(first[1], random.Random(7), sigma=0.3)


# ---- in memory, on pico models --------------------------------------------------------------------------------
def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def family(tiny_model_factory) -> dict[str, dict[str, torch.Tensor]]:
    base = tiny_model_factory("llama", seed=0, layers=LAYERS)
    tunes = {m: tiny_model_factory("llama", seed=s, base=base, layers=LAYERS) for m, s in (("a", 1), ("b", 2))}
    return {"base": weights(base), **{m: weights(p) for m, p in tunes.items()}}


def hand_built(path: list[Step], state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The layer stack by hand: output layer j is the j-th run step's layer, o_proj/down_proj times its scale;
    embeddings from the first run step's model, final norm and head from the last one's."""
    run = [step for step in path if step.source is not None]
    out: dict[str, torch.Tensor] = {}
    for j, step in enumerate(run):
        assert step.source is not None
        prefix = f"model.layers.{step.layer}."
        for name, tensor in state[step.source].items():
            if name.startswith(prefix):
                factor = step.scale if ("o_proj" in name or "down_proj" in name) else 1.0
                out[re.sub(r"layers\.\d+\.", f"layers.{j}.", name, count=1)] = tensor.float() * factor
    out["model.embed_tokens.weight"] = state[run[0].source or ""]["model.embed_tokens.weight"].float()
    for name in ("model.norm.weight", "lm_head.weight"):
        out[name] = state[run[-1].source or ""][name].float()
    return out


def assert_same(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name].float(), tensor), name


def test_a_decoded_path_merged_in_memory_is_the_hand_built_layer_stack(family):
    s = space()
    assert s.dataflow is not None
    recipe = s.decode(encode_path(s.dataflow, s.dataflow_sources(), PATH))
    assert_same(merge_state_dicts(recipe, family), hand_built(PATH, family))


def test_ps_plus_dfs_draws_layers_from_the_ps_merge_as_one_more_source(family):
    # Stage 1 (PS): a task-arithmetic merge; stage 2 (DFS): its result is one more source of the path.
    ps = MergeRecipe.model_validate(
        {
            "strategy": "task_arithmetic",
            "base_model": "base",
            "models": [{"model": "a", "parameters": {"weight": 0.7}}, {"model": "b", "parameters": {"weight": 0.4}}],
            "parameters": {"lambda": 1.0},
        }
    )
    states = {**family, "ps-winner": merge_state_dicts(ps, family)}
    s = space(models=("a", "b", "ps-winner"), repeats=1, init_source="ps-winner")
    assert s.dataflow is not None and s.dataflow_sources() == ["a", "b", "ps-winner", "base"]
    assert s.decode_dict(s.initial())["slices"] == [piece("ps-winner", 0, LAYERS, 1.0)]
    path = [Step(source="ps-winner", layer=0, scale=1.0), Step(source="a", layer=1, scale=0.8)]
    path.append(Step(source="ps-winner", layer=2, scale=1.1))
    recipe = s.decode(encode_path(s.dataflow, s.dataflow_sources(), path))
    assert [p.model for p in recipe.slices or []] == ["ps-winner", "a", "ps-winner"]
    assert_same(merge_state_dicts(recipe, states), hand_built(path, states))


def test_an_evolution_request_carries_a_dataflow_genome_to_the_space():
    spec = parse_spec(
        {
            "models": ["a", "b"],
            "base_model": "base",
            "datasets": ["d"],
            "strategy": "franken_merge",
            "genome": {"dataflow": {"num_layers": 4, "repeats": 2, "scale": [0.8, 1.2, 1.0]}},
            "search": {"seed": 5},
        }
    )
    inputs = ResolvedInputs(
        parents={"base": Path(), "a": Path(), "b": Path()}, base_model="base", dataset_ids=["d"], source=None
    )
    s = genome_space(spec, inputs)
    assert len(s.genes()) == 2 * 8 and s.decode_dict(s.initial())["seed"] == 5


@pytest.mark.parametrize("path", [PATH, [Step(source="a", layer=t % LAYERS, scale=1.0) for t in range(2 * LAYERS)]])
def test_a_candidate_of_another_depth_scores_like_a_model_built_at_that_depth(family, tiny_model_factory, path):
    # The in-memory evaluator's skeleton has the base's 3 layers; PATH runs 3 of 6 steps... and the second path 6.
    import transformers

    from alloy.evaluation.loading import fit_layer_stack

    s = space()
    assert s.dataflow is not None
    merged = merge_state_dicts(s.decode(encode_path(s.dataflow, s.dataflow_sources(), path)), family)
    depth = sum(step.source is not None for step in path)
    skeleton = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama", seed=0, layers=LAYERS))
    fit_layer_stack(skeleton, merged)
    skeleton.load_state_dict(merged, strict=False)
    config = transformers.AutoConfig.from_pretrained(tiny_model_factory("llama", seed=0, layers=LAYERS))
    config.num_hidden_layers = depth
    fresh = transformers.AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(merged, strict=False)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(skeleton.eval()(input_ids=ids).logits, fresh.eval()(input_ids=ids).logits)
    assert skeleton.config.num_hidden_layers == depth


def test_the_bench_second_stage_adds_the_ps_winner_as_a_source_and_the_initial_path():
    from bench.evolve_bench import second_stage

    class Service:  # resolves the PS request's preset to its parents, as EvolutionService does
        def resolve_inputs(self, spec):
            parents = {"base": Path(), "a": Path(), "b": Path()}
            return ResolvedInputs(parents=parents, base_model="base", dataset_ids=["d1", "d2"], source=None)

    ps = {
        "name": "ps",
        "preset": "causal-lm",
        "strategy": "task_arithmetic",
        "genome": {"per_model": {"weight": [0, 1]}},
    }
    dfs = {
        "name": "dfs",
        "preset": "causal-lm",
        "strategy": "franken_merge",
        "genome": {"dataflow": {"num_layers": LAYERS}},
        "search": {"seed": 1},
    }
    request = second_stage(dfs, Service(), ps, {"model_id": "ps-winner"})
    assert "preset" not in request and request["models"] == ["a", "b", "ps-winner"]
    assert request["base_model"] == "base" and request["datasets"] == ["d1", "d2"]
    s = genome_space(
        parse_spec(request),
        ResolvedInputs(
            parents={m: Path() for m in ["base", *request["models"]]},
            base_model="base",
            dataset_ids=request["datasets"],
            source=None,
        ),
    )
    assert s.decode_dict(s.initial())["slices"] == [piece("ps-winner", 0, LAYERS, 1.0)]
    assert "preset" in dfs  # the shared DFS request is left as it was
