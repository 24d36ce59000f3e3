"""Per-dataset objectives and the Pareto front (the multi-objective search kind)."""

from __future__ import annotations

import json

import pytest

from alloy.wire_evolution import ParetoMember
from evolution.genome import Bounds, GenomeSpace
from evolution.objectives import dominates, front_of, objective_keys, objectives_in, objectives_of, pareto_indices
from evolution.scoring import FitnessLedger
from evolution.trainable import _repeat_result


def test_dominance_needs_no_worse_everywhere_and_better_somewhere():
    assert dominates([1, 2], [1, 1]) and not dominates([1, 1], [1, 1]) and not dominates([2, 0], [1, 1])


def test_the_front_keeps_every_trade_off_once():
    points = [[0.9, 0.1], [0.5, 0.5], [0.4, 0.4], [0.1, 0.9], [0.5, 0.5], [0.9, 0.05]]
    assert pareto_indices(points) == [0, 1, 3]  # [0.4, 0.4] and [0.9, 0.05] are dominated, the repeat listed once


def test_front_of_signs_lower_is_better_metrics_and_orders_by_fitness():
    def member(name, a, b):
        return ParetoMember(
            candidate_id=name, generation=1, fitness=-(a + b) / 2, scores={"a": a, "b": b}, genome={}, recipe={}
        )

    # perplexity-like: lower is better, so sign -1; "w" is worse than "x" on both
    members = [member("w", 5, 5), member("x", 4, 4), member("y", 2, 9), member("z", 9, 1)]
    front = front_of(members, ["a", "b"], sign=-1.0)
    assert [m.candidate_id for m in front] == ["x", "z", "y"]  # best fitness (-4, -5, -5.5) first


def test_objectives_are_signed_per_dataset_in_request_order():
    metrics = {"d/one": 0.25, "d/two": 0.75, "mean_accuracy": 0.5}
    assert objectives_of(metrics, ["d/two", "d/one"], 1.0) == {"objective_0": 0.75, "objective_1": 0.25}
    assert objective_keys(2) == ["objective_0", "objective_1"]
    assert objectives_in({"fitness": 1.0, "objective_1": 2, "generation": 3}) == {"objective_1": 2.0}


def test_a_repeat_reports_the_objectives_the_genome_scored():
    """NSGA-II reads every objective of every result: a repeated genome must report them (not only fitness)."""
    space = GenomeSpace(
        strategy="task_arithmetic",
        models=["a", "b"],
        base_model="base",
        per_model={"weight": Bounds(low=0.0, high=1.0)},
    )
    ledger = FitnessLedger(space)
    genome = {"weight.0": 0.5, "weight.1": 0.25}
    assert ledger.claim(genome)
    ledger.record_result(
        {
            "candidate_id": "t1-g001",
            "genome_json": json.dumps(genome),
            "fitness": 0.5,
            "objective_0": 0.25,
            "objective_1": 0.75,
        }
    )
    known = ledger.lookup(genome)
    assert known is not None and known.objectives == {"objective_0": 0.25, "objective_1": 0.75}
    repeat = _repeat_result(known, genome, 2, "t1-g001")
    assert repeat["objective_1"] == pytest.approx(0.75) and "candidate_id" not in repeat


@pytest.mark.parametrize(
    ("kind", "sampler", "metric"),
    [
        ("nsga2", "NSGAIISampler", ["objective_0", "objective_1", "objective_2"]),
        ("random", "RandomSampler", "fitness"),
        ("cmaes", "CmaEsSampler", "fitness"),
        ("tpe", "TPESampler", "fitness"),
    ],
)
def test_each_optuna_kind_asks_a_generation_at_a_time_with_its_sampler(kind, sampler, metric):
    from evolution.config import SearchSettings
    from evolution.sampled import OrdinalLimiter, optuna_tune_config

    space = GenomeSpace(
        strategy="task_arithmetic", models=["a", "b"], base_model="base", per_model={"weight": Bounds(low=0, high=1)}
    )
    settings = SearchSettings(kind=kind, population=4, generations=3, seed=7)
    config = optuna_tune_config(space, settings, objectives=3)
    limiter = config.search_alg
    assert isinstance(limiter, OrdinalLimiter) and limiter.batch and limiter.max_concurrent == 4
    assert type(limiter.searcher._sampler).__name__ == sampler
    assert limiter.searcher.metric == metric and config.num_samples == 4 * 3  # the same budget for every kind


@pytest.mark.parametrize("kind", ["random", "cmaes", "tpe", "nsga2"])
def test_each_optuna_kind_samples_the_same_genomes_from_one_seed(kind):
    """The sampler of every Optuna kind is seeded from ``search.seed``: two studies asked and told alike draw the
    same genomes. (The integration pair in tests/integration/test_evolution_reproducible.py runs whole
    Tune searches twice for PBT and two of these kinds; this covers the sampler of each. A repeated genome is the
    search's business, not the sampler's: NSGA-II's crossover may give one back, the genome cache scores it once.)"""
    import optuna

    from evolution.config import SearchSettings
    from evolution.sampled import _sampler

    space = GenomeSpace(
        strategy="task_arithmetic", models=["a", "b"], base_model="base", per_model={"weight": Bounds(low=0, high=1)}
    )
    genes = {gene.name: optuna.distributions.FloatDistribution(0.0, 1.0) for gene in space.genes()}
    directions = ["maximize", "maximize"] if kind == "nsga2" else ["maximize"]

    def genomes() -> list[dict[str, float]]:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        settings = SearchSettings(kind=kind, population=3, generations=3, seed=5)
        study = optuna.create_study(directions=directions, sampler=_sampler(space, settings, None))
        asked = []
        for _ in range(settings.population * settings.generations):
            trial = study.ask(genes)
            asked.append(trial.params)
            score = sum(trial.params.values())
            study.tell(trial, [score, -score] if kind == "nsga2" else score)
        return asked

    first, second = genomes(), genomes()
    assert first == second
    assert len({tuple(sorted(g.items())) for g in first}) >= len(first) - 1  # it samples: not one point again
