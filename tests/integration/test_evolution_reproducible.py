"""A real Ray Tune search on the ``tiny`` preset, run twice from one seed: the same candidates (genome, generation,
fitness) both times, every candidate a distinct genome, none scored twice (issue 18, item 1); for every search kind,
and with the operator (merge method) gene."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from alloy.evaluation.dataset_sources import LocalDatasets
    from alloy.zoo.presets import build_preset
    from evolution.parents import load_parents
    from evolution.scoring import InMemoryDatasets

    manifest = build_preset("tiny", tmp_path_factory.mktemp("tiny-preset"))
    base = manifest.base
    finetunes = [m.model_id for m in manifest.finetunes(base.model_id)]
    dataset_ids = [
        d.dataset_id
        for d in manifest.datasets
        if d.task.get("type") == "classification" and not d.dataset_id.endswith("lm-kind")
    ]
    data = InMemoryDatasets.read(LocalDatasets(manifest.datasets), dataset_ids, ["dev"])
    parents = load_parents({base.model_id: base.path, **{m: manifest.model(m).path for m in finetunes}})
    return base, finetunes, dataset_ids, data, parents


def search(tiny_inputs, tmp_path, run_name: str, kind: str, seed: int, operators: list[str] | None = None):
    from evolution.config import SearchSettings
    from evolution.genome import Bounds, GenomeSpace
    from evolution.runner import run_search
    from evolution.scoring import ScorerSpec

    base, finetunes, dataset_ids, data, parents = tiny_inputs
    space = GenomeSpace(
        strategy="task_arithmetic",
        models=finetunes,
        base_model=base.model_id,
        per_model={"weight": Bounds(low=0.0, high=1.5, init=1.0)},
        global_parameters={"lambda": Bounds(low=0.1, high=1.5, init=0.5)},
        operators=operators,
        seed=seed,
    )
    settings = SearchSettings(
        kind=kind, population=3, generations=3, seed=seed, dev_batch_size=8, cpus_per_trial=0.5, time_budget_s=600
    )
    outcome = run_search(
        run_name=run_name,
        storage_path=tmp_path,
        space=space,
        settings=settings,
        parents=parents,
        data=data,
        scorer=ScorerSpec(run=run_name, model_dir=str(base.path), dataset_ids=dataset_ids, split="dev"),
    )
    assert not outcome.errored_trials
    return space, outcome.candidates


def fingerprint(candidates):
    return sorted((c.generation, json.dumps(c.genome, sort_keys=True), c.fitness) for c in candidates)


# The operator (merge method) gene rides along with the two kinds that step it differently (PBT's categorical
# perturbation, NSGA-II's crossover): one pair of runs per kind keeps this module's Tune runs to eight.
OPERATORS = {"pbt": ["task_arithmetic", "ties", "tsv", "iso_c"], "nsga2": ["task_arithmetic", "ties", "tsv", "iso_c"]}


@pytest.mark.parametrize("kind", ["pbt", "cmaes", "random", "nsga2"])
def test_one_seed_gives_the_same_distinct_candidates_twice(ray_cluster, tiny_inputs, tmp_path, kind):
    from evolution.scoring import genome_key

    operators = OPERATORS.get(kind)
    space, first = search(tiny_inputs, tmp_path, f"repro-{kind}-a", kind, seed=5, operators=operators)
    _, second = search(tiny_inputs, tmp_path, f"repro-{kind}-b", kind, seed=5, operators=operators)
    assert len(first) == 3 * 3  # population x generations, every one a candidate
    assert len({genome_key(space, c.genome) for c in first}) == len(first)
    assert fingerprint(first) == fingerprint(second)
    if operators:
        methods = [c.recipe["variant"] for c in first]
        assert set(methods) <= set(operators) and len(set(methods)) > 1, methods  # the method is searched
    if kind == "pbt":  # every trial moved every generation
        by_trial = {}
        for candidate in sorted(first, key=lambda c: c.generation):
            by_trial.setdefault(candidate.trial_id, []).append(candidate.genome)
        assert all(a != b for genomes in by_trial.values() for a, b in zip(genomes, genomes[1:]))
