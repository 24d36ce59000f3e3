"""Every PBT candidate is a new genome and one seed gives one run, checked on GenomePBT itself (no cluster):
synchronous rounds driven by hand over stub trials, with a fitness that depends on the genome only."""

from __future__ import annotations

import json
import random
import tempfile

import pytest
from ray.train import Checkpoint
from ray.train._internal.session import _TrainingResult
from ray.tune.experiment import Trial
from ray.tune.search import Searcher

from evolution.config import SearchSettings
from evolution.genome import Bounds, GenomeSpace
from evolution.sampled import OrdinalLimiter
from evolution.scoring import FitnessLedger, genome_key
from evolution.search import FRESH_TRIES, GenomeExplorer, GenomePBT, build_tune_config
from evolution.trainable import CACHED_KEY, GENOME_KEY, LINEAGE_KEY

SPACE = GenomeSpace(
    strategy="task_arithmetic",
    models=["a", "b", "c"],
    base_model="base",
    per_model={"weight": Bounds(low=0.0, high=1.5, init=1.0)},
    global_parameters={"lambda": Bounds(low=0.1, high=1.5, init=0.5)},
)


def fitness_of(genome: dict[str, float]) -> float:
    return -sum((value - 0.7) ** 2 for value in genome.values())


class Controller:
    """What GenomePBT asks of Tune's controller in a synchronous round."""

    def __init__(self, trials):
        self.trials = trials
        self.search_alg = None
        self.folder = tempfile.mkdtemp(prefix="alloy-pbt-test-")

    def get_live_trials(self):
        return [t for t in self.trials if t.status != Trial.TERMINATED]

    def get_trials(self):
        return list(self.trials)

    def _schedule_trial_save(self, trial, result=None):
        return Checkpoint.from_directory(self.folder)

    def pause_trial(self, trial, should_checkpoint=True):
        trial.set_status(Trial.PAUSED)


def run_rounds(
    seed: int,
    population: int = 4,
    generations: int = 5,
    space: GenomeSpace = SPACE,
    sigma: float = 0.1,
    resample_probability: float = 0.1,
):
    """Drive ``generations`` synchronous rounds; returns every (generation, trial index, genome, lineage)."""
    settings = SearchSettings(
        population=population,
        generations=generations,
        seed=seed,
        sigma=sigma,
        resample_probability=resample_probability,
    )
    tune_config, param_space = build_tune_config(space, settings)
    scheduler: GenomePBT = tune_config.scheduler
    scheduler.set_search_properties("fitness", "max")
    scheduler._log_config = False  # the policy log needs a Tune storage folder that stub trials lack
    trials = [
        Trial("__fake", config={GENOME_KEY: genome}, stub=True, trial_id=f"t{i}")
        for i, genome in enumerate(param_space[GENOME_KEY]["grid_search"])
    ]
    controller = Controller(trials)
    for trial in trials:
        scheduler.on_trial_add(controller, trial)
    seen = []
    for generation in range(1, generations + 1):
        for index, trial in enumerate(trials):
            trial.set_status(Trial.RUNNING)
            genome = trial.config[GENOME_KEY]
            assert trial.config.get(CACHED_KEY) is None
            seen.append((generation, index, genome, trial.config.get(LINEAGE_KEY)))
            result = {
                "generation": generation,
                "fitness": fitness_of(genome),
                "candidate_id": f"t{index}-g{generation}",
                "genome_json": json.dumps(genome, sort_keys=True),
            }
            # the trainable reports a checkpoint with every result (a PAUSED trial is exploited from it)
            trial.run_metadata.checkpoint_manager._latest_checkpoint_result = _TrainingResult(
                checkpoint=Checkpoint.from_directory(controller.folder), metrics=result
            )
            scheduler.on_trial_result(controller, trial, result)
            trial.set_status(Trial.PAUSED)
    return seen


def test_every_candidate_of_every_generation_is_a_distinct_genome():
    seen = run_rounds(seed=0)
    keys = [genome_key(SPACE, genome) for _, _, genome, _ in seen]
    assert len(seen) == 4 * 5 and len(set(keys)) == len(keys)


def test_surviving_trials_step_and_exploited_ones_perturb_their_donors_scored_genome():
    seen = run_rounds(seed=0, sigma=0.01, resample_probability=0.0)
    by_trial = {}
    for _generation, index, genome, lineage in seen:
        by_trial.setdefault(index, []).append((genome, lineage))
    exploited = 0
    for index, history in by_trial.items():
        for (before, _), (after, lineage) in zip(history, history[1:]):
            assert after != before  # a step every generation
            if lineage and lineage["trial_id"] != f"t{index}":
                exploited += 1
    assert exploited >= 4  # one of four trials exploited in each of the 4 rounds
    # an exploited genome is a small step from the genome its donor scored (not from the donor's next step)
    scored = {f"t{index}-g{generation}": genome for generation, index, genome, _ in seen}
    for generation, _index, genome, lineage in seen:
        if lineage and lineage["candidate_id"] and lineage["generation"] == generation - 1:
            donor = scored[lineage["candidate_id"]]
            assert max(abs(genome[g] - donor[g]) for g in genome) < 0.08  # 5 sigma of the widest gene


def test_one_seed_gives_one_run_and_another_seed_another():
    first, again, other = (run_rounds(seed=s, population=8) for s in (7, 7, 8))
    strip = [(g, i, genome) for g, i, genome, _ in first]
    assert strip == [(g, i, genome) for g, i, genome, _ in again]
    assert [lin for *_, lin in first] == [lin for *_, lin in again]
    assert strip != [(g, i, genome) for g, i, genome, _ in other]


def test_the_global_random_state_does_not_decide_the_donors():
    from ray.tune.schedulers import pbt

    random.seed(1)
    first = run_rounds(seed=3, population=8)  # two trials in the top quantile: the donor is a real draw
    random.seed(2)
    assert run_rounds(seed=3, population=8) == first
    assert pbt.random is random  # the scheduler's generator stood in only for the length of its calls


def test_a_space_without_fresh_neighbours_falls_back_to_the_ledgers_fitness():
    # One gene whose decoded value rounds to 6 decimals, bounds so narrow that every draw decodes the same.
    tight = GenomeSpace(
        strategy="task_arithmetic",
        models=["a"],
        base_model="base",
        global_parameters={"lambda": Bounds(low=0.5, high=0.5 + 2e-7)},
    )
    explorer = GenomeExplorer(tight, sigma=0.1, resample_probability=0.0, seed=0)
    scheduler = GenomePBT(space=tight, explorer=explorer, seed=0, metric="fitness", mode="max")
    genome = tight.initial()
    scheduler._ledger.claim(genome)
    scheduler._ledger.record(genome, "t0-g1", 0.25)
    child, known = scheduler._fresh(genome)
    assert genome_key(tight, child) == genome_key(tight, genome)
    assert known == {"candidate_id": "t0-g1", "fitness": 0.25, "objectives": {}, "full_dev": False, "rung_scores": []}
    assert FRESH_TRIES > 1


def test_ledger_keys_are_the_decoded_recipe():
    ledger = FitnessLedger(SPACE)
    genome = SPACE.initial()
    assert ledger.claim(genome) and not ledger.claim(dict(genome))
    nudged = {name: value + 1e-9 for name, value in genome.items()}  # the decoder rounds to 6 decimals
    assert not ledger.claim(nudged)
    assert ledger.lookup(genome) is None
    ledger.record_result({"candidate_id": "x-g001", "fitness": 0.5, "genome_json": json.dumps(genome)})
    assert ledger.lookup(nudged).candidate_id == "x-g001"
    ledger.record_result({"repeat_of": "x-g001", "fitness": 0.5, "genome_json": json.dumps(genome)})
    assert ledger.lookup(genome).candidate_id == "x-g001"


def test_cmaes_limiter_tells_a_repeated_suggestion_its_recorded_fitness():
    genome = SPACE.initial()

    class Repeating(Searcher):  # a searcher that keeps suggesting one genome
        def suggest(self, trial_id):
            return {GENOME_KEY: dict(genome)}

        def on_trial_complete(self, trial_id, result=None, error=False):
            pass

    limiter = OrdinalLimiter(Repeating(), max_concurrent=2, batch=True, space=SPACE)
    first = limiter.suggest("a")
    assert CACHED_KEY not in first
    result = {"candidate_id": "a-g001", "fitness": 0.3, "objective_0": 0.5, "genome_json": json.dumps(genome)}
    limiter.on_trial_complete("a", result)
    second = limiter.suggest("b")
    # the per-dataset objectives too: NSGA-II reads them from the repeat's result
    assert second[CACHED_KEY] == {
        "candidate_id": "a-g001",
        "fitness": 0.3,
        "objectives": {"objective_0": 0.5},
        "full_dev": False,  # the result did not say it was the whole dev split's
        "rung_scores": [],
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_cmaes_asks_a_whole_batch_at_a_time(seed):
    tune_config, _ = build_tune_config(SPACE, SearchSettings(kind="cmaes", population=3, generations=2, seed=seed))
    assert tune_config.search_alg.batch and tune_config.search_alg.max_concurrent == 3
