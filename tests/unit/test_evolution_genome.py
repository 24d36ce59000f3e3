"""The genome: bounded genes, decoding to recipes Alloy accepts, perturbation inside the bounds."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from pydantic import ValidationError

from alloy.merge.recipe import validate_recipe
from evolution.genome import Bounds, FrankenGenome, GenomeSpace


def ties_space(**overrides) -> GenomeSpace:
    fields = dict(
        strategy="ties",
        models=["org/a", "b"],
        base_model="org/base",
        per_model={"weight": [0.0, 1.0, 0.5], "density": [0.1, 1.0]},
        global_parameters={"lambda": [0.1, 2.0, 1.0]},
        fixed={"normalize": True},
    )
    fields.update(overrides)
    return GenomeSpace(**fields)


def test_genes_are_named_without_slashes_even_for_org_model_ids():
    names = [gene.name for gene in ties_space(layer_groups=3).genes()]
    assert len(names) == (2 * 2 + 1) * 3
    assert not any("/" in name for name in names)


def test_every_decoded_genome_is_a_valid_recipe():
    space = ties_space(layer_groups=2)
    rng = random.Random(1)
    for genome in [space.initial(), *space.population(5, seed=3)]:
        recipe = validate_recipe(space.decode(genome))
        assert [m.model for m in recipe.models] == ["org/a", "b"]
        assert recipe.base_model == "org/base"
        assert len(recipe.models[0].parameters["density"]) == 2  # a gradient over two layer groups
        assert recipe.parameters["normalize"] is True
        genome = space.perturb(genome, rng, sigma=0.5)


def test_perturb_stays_inside_bounds_and_changes_something():
    space = ties_space()
    rng = random.Random(0)
    genome = space.initial()
    for _ in range(200):
        child = space.perturb(genome, rng, sigma=1.0, resample_probability=0.2)
        for gene in space.genes():
            assert gene.bounds.low <= child[gene.name] <= gene.bounds.high
        assert child != genome
        genome = child


def test_population_is_reproducible_and_starts_from_the_seed_individual():
    space = ties_space()
    assert space.population(4, seed=7) == space.population(4, seed=7)
    assert space.population(4, seed=7)[0] == space.initial()
    assert space.initial()["lambda"] == 1.0


def test_a_spread_population_stays_near_the_seed_individual():
    space = ties_space()
    seed = space.initial()
    uniform = space.population(40, seed=1)[1:]
    near = space.population(40, seed=1, spread=0.05)[1:]
    assert near == space.population(40, seed=1, spread=0.05)[1:]  # reproducible too

    def mean_distance(members):  # in units of each gene's range
        genes = space.genes()
        return sum(
            sum(abs(m[g.name] - seed[g.name]) / (g.bounds.high - g.bounds.low) for g in genes) / len(genes)
            for m in members
        ) / len(members)

    assert mean_distance(near) < 0.08 < 0.2 < mean_distance(uniform)  # E|N(0, 0.05)| = 0.04; uniform ~ 0.3
    assert all(g.bounds.low <= m[g.name] <= g.bounds.high for m in near for g in space.genes())
    assert len({tuple(sorted(m.items())) for m in near}) == len(near)


@pytest.mark.parametrize(
    "bad",
    [
        {"strategy": "ties", "per_model": {"lambda": [0, 1]}},  # global parameter searched per model
        {"strategy": "ties", "per_model": {"density": [0, 2]}},  # outside its legal range
        {"strategy": "ties", "per_model": {"bogus": [0, 1]}},
        {"strategy": "nonsense"},
        {"strategy": "ties", "per_model": {"weight": [1, 0]}},  # low above high
    ],
)
def test_spaces_that_could_decode_to_refused_recipes_are_rejected(bad):
    with pytest.raises((ValidationError, ValueError)):
        ties_space(**bad)


def test_validate_genome_refuses_foreign_genes_and_clips_strays():
    space = ties_space()
    genome = space.initial()
    with pytest.raises(ValueError):
        space.validate_genome({**genome, "extra": 1.0})
    assert space.validate_genome({**genome, "lambda": 99.0})["lambda"] == 2.0


def test_franken_layer_order_genome_decodes_to_slices():
    space = GenomeSpace(
        strategy="franken_merge", models=["a", "b"], franken=FrankenGenome(slots=3, num_layers=4, max_slice=2)
    )
    rng = random.Random(5)
    for genome in [space.initial(), *(space.sample(rng) for _ in range(20))]:
        recipe = validate_recipe(space.decode(genome))
        assert recipe.slices
        for piece in recipe.slices:
            start, end = piece.layer_range
            assert 0 <= start < end <= 4 and end - start <= 2


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "configs").glob("evolve-*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_evolution_config_is_a_valid_request_with_a_valid_genome(path):
    from evolution.config import load_spec_file

    spec = load_spec_file(path)
    space = GenomeSpace(
        strategy=spec.strategy,
        models=["a", "b", "c"],
        base_model="base",
        per_model=spec.genome.per_model,
        global_parameters=spec.genome.global_parameters,
        fixed=spec.genome.fixed,
        layer_groups=spec.genome.layer_groups,
        franken=spec.genome.franken,
        dataflow=spec.genome.dataflow,
        operators=spec.genome.operators,
        operator_parameters=spec.genome.operator_parameters,
    )
    for genome in space.population(spec.search.population, seed=spec.search.seed, spread=spec.search.init_spread):
        validate_recipe(space.decode(genome))


# ---- the operator (merge method) choice gene ----------------------------------------------------------------------
OPERATORS = ["task_arithmetic", "ties", "tsv", "iso_c", "iso_cts"]


def operator_space(**extra):
    return GenomeSpace(
        strategy="task_arithmetic",
        models=["a", "b"],
        base_model="base",
        per_model={"weight": Bounds(low=0.0, high=1.5, init=1.0), "density": Bounds(low=0.2, high=1.0, init=0.8)},
        global_parameters={"lambda": Bounds(low=0.1, high=1.5, init=1.0)},
        operators=OPERATORS,
        **extra,
    )


def test_the_operator_gene_decodes_to_the_method_its_family_and_only_its_parameters():
    space = operator_space()
    assert space.genes()[-1].name == "operator" and space.genes()[-1].choices == OPERATORS
    decoded = {}
    for index, method in enumerate(OPERATORS):
        recipe = space.decode({**space.initial(), "operator": index + 0.25})
        decoded[method] = recipe
        assert recipe.variant == method
    assert decoded["ties"].strategy == "ties" and decoded["ties"].models[0].parameters["density"] == 0.8
    for method in ("tsv", "iso_c", "iso_cts"):  # the SVD operators have no density: left out of their recipes
        assert decoded[method].strategy == "task_arithmetic" and "density" not in decoded[method].models[0].parameters
        assert decoded[method].parameters["lambda"] == 1.0
    assert space.operator_of(space.initial()) == "task_arithmetic"  # the first listed method is the init


def test_a_parameter_no_operator_declares_is_refused():
    with pytest.raises(ValueError, match="no operator"):
        GenomeSpace(
            strategy="task_arithmetic",
            models=["a", "b"],
            base_model="base",
            global_parameters={"no_such_knob": Bounds(low=0.0, high=1.0)},
            operators=["tsv", "iso_c"],
        )


def test_a_pbt_step_switches_methods_as_categories_and_keeps_them_at_their_centres():
    space = operator_space()
    rng = random.Random(3)
    steps = [space.perturb(space.initial(), rng, sigma=0.5, resample_probability=0.0) for _ in range(200)]
    values = {step["operator"] for step in steps}
    assert values <= {i + 0.5 for i in range(len(OPERATORS))}
    assert {space.operator_of(step) for step in steps} == set(OPERATORS)  # any other method, not only neighbours
    still = [space.perturb(space.initial(), rng, sigma=0.0, resample_probability=0.0) for _ in range(20)]
    assert {space.operator_of(step) for step in still} == {"task_arithmetic"}


# ---- a parameter with its own gene per method (operator_parameters) ----------------------------------------------
OWN_LAMBDA = {
    "task_arithmetic": Bounds(low=0.2, high=2.0, init=0.8),
    "ties": Bounds(low=0.5, high=3.0, init=1.5),
    "tsv": Bounds(low=0.5, high=4.0, init=2.0),
    "iso_c": Bounds(low=1.0, high=6.0, init=4.0),
    "iso_cts": Bounds(low=1.0, high=6.0, init=3.0),
}


def own_lambda_space(**overrides):
    fields = {
        "strategy": "task_arithmetic",
        "models": ["a", "b"],
        "base_model": "base",
        "per_model": {"weight": Bounds(low=0.0, high=1.5, init=1.0)},
        "operators": OPERATORS,
        "operator_parameters": {"lambda": OWN_LAMBDA},
    }
    return GenomeSpace(**{**fields, **overrides})


def test_each_method_decodes_its_own_lambda_gene():
    space = own_lambda_space()
    names = [gene.name for gene in space.genes()]
    assert names[-5:] == [f"lambda.{method}" for method in OPERATORS] and "lambda" not in names
    genome = {**space.initial(), "lambda.tsv": 2.75}
    for index, method in enumerate(OPERATORS):
        recipe = space.decode({**genome, "operator": index + 0.5})
        expected = 2.75 if method == "tsv" else OWN_LAMBDA[method].init
        assert recipe.variant == method and recipe.parameters["lambda"] == expected


def test_a_pbt_switch_of_method_lands_on_the_new_methods_own_start():
    """The point of a gene per method: a trial at task arithmetic whose lambda drifted to 0.6 switches to TSV-M and
    is scored at TSV-M's own lambda (its start, 2.0), not at 0.6, where TSV-M scores far below its best."""
    space = own_lambda_space()
    rng = random.Random(5)
    at_ta = {**space.initial(), "lambda.task_arithmetic": 0.6}
    steps = [space.perturb(at_ta, rng, sigma=0.05, resample_probability=0.0) for _ in range(2000)]
    to_tsv = [space.decode(g).parameters["lambda"] for g in steps if space.operator_of(g) == "tsv"]
    assert len(to_tsv) >= 10, "sigma 0.05 switches method in ~5% of the steps, to TSV-M in a quarter of those"
    assert min(to_tsv) > 1.2 and statistics.mean(to_tsv) == pytest.approx(2.0, abs=0.1)  # one step from 2.0
    stayed = [space.decode(g).parameters["lambda"] for g in steps if space.operator_of(g) == "task_arithmetic"]
    assert statistics.mean(stayed) == pytest.approx(0.6, abs=0.05)  # task arithmetic keeps its own drifted value


def test_two_genomes_that_differ_only_in_an_unpicked_methods_gene_decode_to_one_recipe():
    space = own_lambda_space()
    first = space.initial()
    second = {**first, "lambda.iso_c": 5.5}  # the operator gene picks task arithmetic: iso_c's lambda is unused
    assert space.decode_dict(first) == space.decode_dict(second)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"operators": None}, "need an operator gene"),
        ({"global_parameters": {"lambda": Bounds(low=0.1, high=1.0)}}, "both a shared and a per-method"),
        ({"operator_parameters": {"lambda": {m: b for m, b in OWN_LAMBDA.items() if m != "iso_c"}}}, "exactly"),
        ({"operator_parameters": {"lambda": {**OWN_LAMBDA, "slerp": Bounds(low=0.1, high=1.0)}}}, "exactly"),
        (
            {
                "operator_parameters": {
                    "lambda": OWN_LAMBDA,
                    "density": {"task_arithmetic": Bounds(low=0.5, high=1.0), "ties": Bounds(low=0.5, high=2.0)},
                }
            },
            "refused recipe",
        ),
        ({"operator_parameters": {"lam.bda": OWN_LAMBDA}}, "may not contain"),
    ],
    ids=["no-operator-gene", "shared-and-own", "a-method-missing", "a-method-not-listed", "outside-legal", "dot"],
)
def test_per_method_parameters_are_refused_when_they_cannot_decode(overrides, message):
    with pytest.raises(ValueError, match=message):
        own_lambda_space(**overrides)
