"""Successive halving on dev subsets (``search.fidelity: asha``), without a cluster: the rung cutoffs and who is
promoted on hand-made scores, the nested seeded subsets ending in the whole split, the cutoffs PBT and the Optuna
limiter hand out (earlier generations only, one bar for a whole generation), and that the ledger and the final
selection never take a subset's estimate for a full-dev fitness."""

from __future__ import annotations

import json

import pytest
from ray.tune.search import Searcher

from alloy.errors import AlloyError
from evolution.config import SearchSettings, parse_spec
from evolution.finalize import finalists
from evolution.racing import Racing, race, racing_of, rung_cutoff
from evolution.sampled import OrdinalLimiter
from evolution.scoring import FitnessLedger
from evolution.search import EvolutionStopper, build_tune_config
from evolution.tracking import Candidate
from evolution.trainable import GENOME_KEY, RUNG_CUTOFFS_KEY
from tests.unit.test_evolution_fresh_genomes import SPACE, Controller

# ---- the rule ------------------------------------------------------------------------------------------------


def test_the_cutoff_is_the_top_one_in_reduction_factor_quantile():
    scores = [0.8, 0.2, 0.6, 0.4]  # sorted 0.2 0.4 0.6 0.8
    assert rung_cutoff(scores, 3) == pytest.approx(0.6)  # position 2/3 * 3 = 2
    assert rung_cutoff(scores, 2) == pytest.approx(0.5)  # position 1.5: halfway between 0.4 and 0.6
    assert rung_cutoff(scores, 4) == pytest.approx(0.65)  # position 2.25
    assert rung_cutoff([0.7], 3) == 0.7
    assert rung_cutoff([], 3) is None  # nothing recorded: everyone goes on


def test_a_candidate_goes_on_while_it_clears_each_bar():
    def scores(*values):
        return lambda rung: values[rung]

    cutoffs = [0.5, 0.7]
    assert race(scores(0.4, 0.9, 0.9), cutoffs, 3) == [0.4]  # stopped at rung 0
    assert race(scores(0.6, 0.65, 0.9), cutoffs, 3) == [0.6, 0.65]  # promoted once, stopped at rung 1
    assert race(scores(0.5, 0.7, 0.1), cutoffs, 3) == [0.5, 0.7, 0.1]  # ties go on; the last rung has no bar
    assert race(scores(0.0, 0.0, 0.3), [None, None], 3) == [0.0, 0.0, 0.3]  # no records yet: the whole split


def test_which_candidates_of_a_generation_reach_the_whole_split():
    racing = Racing(rungs=3, reduction_factor=3)
    # generation 1 (no bars): every candidate went to the whole split
    history = [[0.50, 0.55, 0.52], [0.70, 0.62, 0.60], [0.30, 0.35, 0.33], [0.60, 0.58, 0.57]]
    cutoffs = racing.cutoffs(history)
    # rung 0: sorted 0.30 0.50 0.60 0.70, position 2 -> 0.60; rung 1: 0.35 0.55 0.58 0.62 -> 0.58
    assert cutoffs == [pytest.approx(0.60), pytest.approx(0.58)]
    generation_2 = {"a": (0.65, 0.61, 0.59), "b": (0.59, 0.99, 0.99), "c": (0.62, 0.57, 0.99), "d": (0.60, 0.58, 0.4)}
    reached = {name: race(lambda rung, s=s: s[rung], cutoffs, 3) for name, s in generation_2.items()}
    assert {name: len(scores) - 1 for name, scores in reached.items()} == {"a": 2, "b": 0, "c": 1, "d": 2}
    # generation 3 races against generations 1 and 2 together
    rung_0 = sorted([0.50, 0.70, 0.30, 0.60, 0.65, 0.59, 0.62, 0.60])
    assert racing.cutoffs(history + list(reached.values()))[0] == pytest.approx(rung_cutoff(rung_0, 3))


def test_the_rungs_are_nested_seeded_subsets_ending_in_the_whole_split():
    racing = Racing(rungs=3, reduction_factor=3, seed=4)
    sizes = {"letters": 48, "case": 32}
    rungs = racing.batches(sizes)
    assert len(rungs) == 3 and rungs[-1] is None
    assert {d: len(rungs[0][d]) for d in sizes} == {"letters": 6, "case": 4}  # ceil(48 / 9), ceil(32 / 9)
    assert {d: len(rungs[1][d]) for d in sizes} == {"letters": 16, "case": 11}
    assert all(set(rungs[0][d]) <= set(rungs[1][d]) <= set(range(sizes[d])) for d in sizes)
    assert racing.batches(sizes) == rungs
    assert Racing(rungs=3, reduction_factor=3, seed=5).batches(sizes)[0] != rungs[0]
    assert racing.fraction(0) == pytest.approx(1 / 9) and racing.fraction(2) == 1.0


# ---- settings --------------------------------------------------------------------------------------------------


def test_asha_settings_are_checked():
    assert racing_of(SearchSettings()) is None  # fixed by default: runs are as before
    assert racing_of(SearchSettings(fidelity="asha", rungs=4, reduction_factor=2, seed=9)) == Racing(
        rungs=4, reduction_factor=2, seed=9
    )
    request = {"preset": "tiny", "genome": {"global_parameters": {"lambda": [0.1, 1.5, 0.5]}}}
    for bad in (
        {"fidelity": "asha", "kind": "nsga2"},
        {"fidelity": "asha", "dev_batch_size": 8},
        {"fidelity": "asha", "rungs": 6, "reduction_factor": 5},  # 5 ** 5 > 1024
        {"fidelity": "asha", "reduction_factor": 1},
        {"fidelity": "thrice"},
    ):
        with pytest.raises(AlloyError):
            parse_spec({**request, "search": bad})
    assert parse_spec({**request, "search": {"fidelity": "asha", "dev_batch_size": None}}).search.fidelity == "asha"


# ---- the ledger and the final selection: full-dev only ---------------------------------------------------------


def result(genome, candidate_id, fitness, rung_scores=None, full_dev=None):
    row = {"candidate_id": candidate_id, "fitness": fitness, "genome_json": json.dumps(genome)}
    if rung_scores is not None:
        row["rung_scores_json"] = json.dumps(rung_scores)
    if full_dev is not None:
        row["full_dev"] = full_dev
    return row


def test_the_ledger_never_returns_an_estimate_as_a_full_dev_fitness():
    ledger = FitnessLedger(SPACE)
    stopped, finished = SPACE.initial(), {**SPACE.initial(), "lambda": 1.0}
    ledger.record_result(result(stopped, "a-g001", 0.9, [0.9], full_dev=False))
    ledger.record_result(result(finished, "b-g001", 0.6, [0.7, 0.65, 0.6], full_dev=True))
    assert ledger.lookup(stopped).full_dev is False and ledger.lookup(stopped).fitness == 0.9
    assert ledger.full_dev_fitness(stopped) is None
    assert ledger.full_dev_fitness(finished) == 0.6
    # a full-dev score of the same genome replaces the estimate; a later estimate never replaces a full-dev score
    ledger.record_result(result(stopped, "a-g002", 0.5, [0.9, 0.7, 0.5], full_dev=True))
    ledger.record_result(result(finished, "b-g002", 0.99, [0.99], full_dev=False))
    assert ledger.full_dev_fitness(stopped) == 0.5 and ledger.full_dev_fitness(finished) == 0.6
    assert sorted(ledger.rung_history()) == [[0.7, 0.65, 0.6], [0.9, 0.7, 0.5]]  # the upgrade's rungs
    # a row that does not say is not full-dev (a rotating batch)
    other = {**SPACE.initial(), "lambda": 0.2}
    ledger.record_result(result(other, "c-g001", 0.8))
    assert ledger.full_dev_fitness(other) is None


def test_the_rung_history_does_not_depend_on_the_order_results_arrive():
    genomes = [{**SPACE.initial(), "lambda": value} for value in (0.2, 0.4, 0.6)]
    rows = [result(g, f"t{i}-g001", 0.1 * i, [0.1 * i, 0.2 * i]) for i, g in enumerate(genomes)]
    forward, backward = FitnessLedger(SPACE), FitnessLedger(SPACE)
    for row in rows:
        forward.record_result(row)
    for row in reversed(rows):
        backward.record_result(row)
    assert forward.rung_history() == backward.rung_history()


def candidate(name: str, fitness: float, full_dev: bool | None) -> Candidate:
    metrics = {} if full_dev is None else {"full_dev": full_dev}
    return Candidate(
        candidate_id=f"{name}-g001",
        trial_id=name,
        generation=1,
        fitness=fitness,
        genome={"lambda": len(name) + fitness},
        recipe={},
        metrics=metrics,
    )


def test_a_stopped_candidates_lucky_estimate_is_never_a_finalist():
    pool = [candidate("lucky", 0.95, False), candidate("good", 0.7, True), candidate("fair", 0.6, True)]
    assert [f.candidate.trial_id for f in finalists(pool, 2)] == ["good", "fair"]
    assert [f.candidate.trial_id for f in finalists(pool, 3)] == ["good", "fair"]  # never padded with estimates
    # every candidate on a rotating batch (fidelity fixed): ranked as before, all of them
    batches = [candidate("x", 0.9, False), candidate("yy", 0.8, False)]
    assert [f.candidate.trial_id for f in finalists(batches, 2)] == ["x", "yy"]
    # old rows without the flag: as before
    legacy = [candidate("x", 0.9, None), candidate("yy", 0.8, None)]
    assert [f.candidate.trial_id for f in finalists(legacy, 1)] == ["x"]


# ---- the bars handed out: earlier generations only, one per generation -----------------------------------------


def test_pbt_hands_the_next_generation_the_cutoffs_of_everything_scored_so_far():
    from ray.train import Checkpoint
    from ray.train._internal.session import _TrainingResult
    from ray.tune.experiment import Trial

    settings = SearchSettings(population=4, generations=3, seed=1, fidelity="asha")
    tune_config, param_space = build_tune_config(SPACE, settings)
    scheduler = tune_config.scheduler
    scheduler.set_search_properties("fitness", "max")
    scheduler._log_config = False
    trials = [
        Trial("__fake", config={GENOME_KEY: genome}, stub=True, trial_id=f"t{i}")
        for i, genome in enumerate(param_space[GENOME_KEY]["grid_search"])
    ]
    controller = Controller(trials)
    for trial in trials:
        scheduler.on_trial_add(controller, trial)
    rung_scores = [[0.5, 0.55, 0.52], [0.7, 0.62, 0.6], [0.3], [0.6, 0.58]]
    for index, trial in enumerate(trials):
        assert not trial.config.get(RUNG_CUTOFFS_KEY)  # generation 1: no bars
        trial.set_status(Trial.RUNNING)
        genome = trial.config[GENOME_KEY]
        row = {
            **result(
                genome, f"t{index}-g001", rung_scores[index][-1], rung_scores[index], len(rung_scores[index]) == 3
            ),
            "generation": 1,
        }
        trial.run_metadata.checkpoint_manager._latest_checkpoint_result = _TrainingResult(
            checkpoint=Checkpoint.from_directory(controller.folder), metrics=row
        )
        scheduler.on_trial_result(controller, trial, row)
        trial.set_status(Trial.PAUSED)
    bars = [trial.config[RUNG_CUTOFFS_KEY] for trial in trials]
    # rung 0 from 0.3 0.5 0.6 0.7 -> 0.6; rung 1 from 0.55 0.58 0.62 -> 0.58 + 0.04 * 1/3
    expected = [pytest.approx(0.6), pytest.approx(0.58 + 0.04 / 3)]
    assert all(bar == expected for bar in bars)


def test_the_optuna_limiter_hands_one_generation_one_set_of_cutoffs():
    genomes = iter({**SPACE.initial(), "lambda": 0.1 + 0.05 * i} for i in range(20))

    class Fresh(Searcher):
        def suggest(self, trial_id):
            return {GENOME_KEY: next(genomes)}

        def on_trial_complete(self, trial_id, result=None, error=False):
            pass

    racing = Racing(rungs=2, reduction_factor=2)
    limiter = OrdinalLimiter(Fresh(), max_concurrent=2, batch=True, space=SPACE, racing=racing)
    first = [limiter.suggest("a"), limiter.suggest("b")]
    assert [c[RUNG_CUTOFFS_KEY] for c in first] == [[None], [None]]
    limiter.on_trial_complete("a", result(first[0][GENOME_KEY], "a-g000", 0.4, [0.4], full_dev=False))
    limiter.on_trial_complete("b", result(first[1][GENOME_KEY], "b-g000", 0.6, [0.8, 0.6], full_dev=True))
    second = [limiter.suggest("c"), limiter.suggest("d")]
    assert [c[RUNG_CUTOFFS_KEY] for c in second] == [[pytest.approx(0.6)], [pytest.approx(0.6)]]


def test_a_stopped_candidates_estimate_does_not_reach_the_target_fitness():
    stopper = EvolutionStopper("racing-target", generations=5, target_fitness=0.9)
    stopper("t0", {"fitness": 0.95, "generation": 1, "rung": 0, "full_dev": False})
    assert not stopper.stop_all()
    stopper("t1", {"fitness": 0.91, "generation": 1, "rung": 2, "full_dev": True})
    assert stopper.stop_all()
    fixed = EvolutionStopper("fixed-target", generations=5, target_fitness=0.9)
    fixed("t0", {"fitness": 0.95, "generation": 1, "full_dev": False})  # a rotating batch, as before
    assert fixed.stop_all()


def test_the_starting_genome_is_always_a_finalist_when_it_competes():
    """A neighbour that was lucky on its small batch may outrank the starting genome; the start still goes to the
    whole-dev re-scoring, so the winner never scores below it there (PS+DFS starts at the PS winner)."""
    start, lucky, other = candidate("start", 0.5, None), candidate("lucky", 0.9, None), candidate("xx", 0.7, None)
    pool = [start, lucky, other]
    chosen = [f.candidate.trial_id for f in finalists(pool, 1, keep=start.genome)]
    assert chosen == ["lucky", "start"]
    assert [f.candidate.trial_id for f in finalists(pool, 3, keep=start.genome)] == ["lucky", "xx", "start"]  # once
    assert [f.candidate.trial_id for f in finalists(pool, 1)] == ["lucky"]  # without keep: as before
    assert [f.candidate.trial_id for f in finalists(pool, 1, keep={"lambda": 123.0})] == ["lucky"]  # never scored
    # racing: a start stopped on a dev subset does not compete against full-dev scores
    raced = [candidate("start", 0.9, False), candidate("good", 0.7, True)]
    assert [f.candidate.trial_id for f in finalists(raced, 1, keep=raced[0].genome)] == ["good"]
