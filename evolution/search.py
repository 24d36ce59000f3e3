"""Ray Tune search over genomes: population-based training (exploit a top genome, explore by perturbing it) or
CMA-ES through Optuna, behind one ``build_tuner``/``restore_tuner`` pair.

Everything handed to Tune here is picklable plain data (Tune stores the scheduler, searcher, stopper and
callbacks in the experiment folder so that ``Tuner.restore`` can continue a run after a forced shutdown).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ray import tune
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.stopper import Stopper

from evolution.config import SearchSettings
from evolution.genome import GenomeSpace
from evolution.trainable import GENOME_KEY, LINEAGE_KEY, ORDINAL_KEY

METRIC = "fitness"
MODE = "max"


class GenomeExplorer:
    """PBT's ``custom_explore_fn``: perturb the copied genome inside its bounds (PBT's built-in explore would
    multiply values by 0.8/1.2 and leave the bounds)."""

    def __init__(self, space: GenomeSpace, sigma: float, resample_probability: float, seed: int):
        self.space = space
        self.sigma = sigma
        self.resample_probability = resample_probability
        self.rng = random.Random(seed)

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        config = dict(config)
        config[GENOME_KEY] = self.space.perturb(config[GENOME_KEY], self.rng, self.sigma, self.resample_probability)
        return config


class GenomePBT(PopulationBasedTraining):
    """PBT whose exploit also hands the donor's lineage (its last candidate and generation) to the recipient
    through the config, taken from the donor's last reported *result*: the recipient then needs nothing from
    the donor's checkpoint files, which Tune may already have rotated away.

    Its clock is the candidate's ``generation`` (``time_attr``), not Tune's ``training_iteration``: a restored trial
    re-runs the generation of its checkpoint and an exploited one continues its donor's generation, so iteration
    counts drift apart between trials while generations stay comparable. ``on_trial_result`` also keeps the
    synchronous rounds sound after ``Tuner.restore``."""

    def on_trial_result(self, tune_controller, trial, result):
        if self._synch and self._time_attr in result and self._metric in result:
            # Tuner.restore brings the trials back at different generations (each from its own last checkpoint).
            # A round among trials at different generations would hand a laggard a donor's later generation, and
            # the laggard would skip the generations in between. Moving the barrier to the leading generation
            # keeps the laggards running (PBT resumes paused trials that are before the barrier) and holds the
            # round until every live trial is level. In an uninterrupted run every trial is level anyway.
            generation = result[self._time_attr]
            leading = max(
                [generation]
                + [self._trial_state[t].last_train_time for t in tune_controller.get_live_trials() if t is not trial]
            )
            self._next_perturbation_sync = max(self._next_perturbation_sync, leading)
            if generation < leading:  # a laggard: record it and let it run on (Ray would start a round with it)
                self._save_trial_state(self._trial_state[trial], generation, result, trial)
                return TrialScheduler.CONTINUE
        barrier = self._next_perturbation_sync
        decision = super().on_trial_result(tune_controller, trial, result)
        if self._synch and self._next_perturbation_sync != barrier:
            # A synchronous round just ran. Ray sets the next barrier to max(previous + interval, newest train
            # time). After Tuner.restore the scheduler starts fresh (previous = its initial value) while the
            # restored trials are already at generation g, so the barrier becomes g itself: no paused trial is
            # "before the barrier", none is ever resumed, and the run hangs with every trial PAUSED. The next
            # barrier lies one interval beyond the newest train time (the same value in an uninterrupted run).
            newest = max(state.last_train_time for state in self._trial_state.values())
            self._next_perturbation_sync = max(self._next_perturbation_sync, newest + self._perturbation_interval)
        return decision

    def _get_new_config(self, trial, trial_to_clone):
        new_config, operations = super()._get_new_config(trial, trial_to_clone)
        donor_result = self._trial_state[trial_to_clone].last_result or {}
        new_config[LINEAGE_KEY] = {
            "trial_id": trial_to_clone.trial_id,
            "candidate_id": donor_result.get("candidate_id"),
            "generation": int(donor_result.get("generation", 0)),
        }
        return new_config, operations


# Cancellation flags of the runs in this process (not pickled: a restored run registers its own).
_CANCEL_FLAGS: dict[str, threading.Event] = {}
_EXTERNAL_CANCEL: dict[str, Callable[[], bool]] = {}


def cancel_flag(run_name: str) -> threading.Event:
    return _CANCEL_FLAGS.setdefault(run_name, threading.Event())


def set_external_cancel_check(run_name: str, check: Callable[[], bool] | None) -> None:
    """A (throttled) check of a cancel request made elsewhere, e.g. through the API for a batch run."""
    if check is None:
        _EXTERNAL_CANCEL.pop(run_name, None)
    else:
        _EXTERNAL_CANCEL[run_name] = check


def is_cancelled(run_name: str) -> bool:
    """Cancelled in this process, or (asked now, unthrottled) elsewhere."""
    if cancel_flag(run_name).is_set():
        return True
    check = _EXTERNAL_CANCEL.get(run_name)
    return bool(check()) if check is not None else False


class EvolutionStopper(Stopper):
    """Stops a trial after the last generation; stops everything on the target fitness or a cancel request."""

    def __init__(self, run_name: str, generations: int, target_fitness: float | None, poll_s: float = 0.5):
        self.run_name = run_name
        self.generations = generations
        self.target_fitness = target_fitness
        self.poll_s = poll_s  # a cancel check is one JobStore row read: cheap enough twice a second
        self._reached = False
        self._last_poll = 0.0
        self._cancelled = False

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if self.target_fitness is not None and result.get(METRIC, float("-inf")) >= self.target_fitness:
            self._reached = True
        return result.get("generation", 0) >= self.generations

    def stop_all(self) -> bool:
        return self._reached or self.cancelled()

    def cancelled(self) -> bool:
        if self._cancelled or cancel_flag(self.run_name).is_set():
            self._cancelled = True
            return True
        check = _EXTERNAL_CANCEL.get(self.run_name)
        now = time.monotonic()
        if check is not None and now - self._last_poll >= self.poll_s:
            self._last_poll = now
            self._cancelled = bool(check())
        return self._cancelled

    def __getstate__(self):  # the cancel state belongs to one process's run
        state = self.__dict__.copy()
        state["_cancelled"] = False
        state["_last_poll"] = 0.0
        return state


def initial_population(space: GenomeSpace, settings: SearchSettings) -> list[dict[str, float]]:
    return space.population(
        settings.population, seed=settings.seed, include_initial=settings.include_initial, spread=settings.init_spread
    )


def build_tune_config(space: GenomeSpace, settings: SearchSettings) -> tuple[tune.TuneConfig, dict[str, Any]]:
    """The TuneConfig and param space of one search kind."""
    if settings.kind == "pbt":
        scheduler = GenomePBT(
            time_attr="generation",  # see GenomePBT
            perturbation_interval=1,  # one exploit/explore round per generation
            quantile_fraction=settings.quantile_fraction,
            custom_explore_fn=GenomeExplorer(space, settings.sigma, settings.resample_probability, settings.seed),
            synch=True,  # every candidate of a generation is ranked on the same dev batch
        )
        population = initial_population(space, settings)
        param_space = {GENOME_KEY: tune.grid_search(population)}
        return tune.TuneConfig(
            metric=METRIC,
            mode=MODE,
            scheduler=scheduler,
            num_samples=1,
            time_budget_s=settings.time_budget_s,
            max_concurrent_trials=settings.max_concurrent_trials,
            reuse_actors=True,
        ), param_space
    return _cmaes_tune_config(space, settings), {}


class OrdinalLimiter(ConcurrencyLimiter):
    """Numbers the suggested candidates (config ``ordinal``): CMA-ES generation = ordinal // population, so the
    candidates of one CMA-ES generation are scored on the same rotating dev batch."""

    _next_ordinal = 0

    def suggest(self, trial_id):
        config = super().suggest(trial_id)
        if isinstance(config, dict):
            config = {**config, ORDINAL_KEY: self._next_ordinal}
            self._next_ordinal += 1
        return config


def _cmaes_tune_config(space: GenomeSpace, settings: SearchSettings) -> tune.TuneConfig:
    # lazy: only the cmaes search needs Optuna
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    genes = space.genes()
    distributions = {
        f"{GENOME_KEY}/{gene.name}": optuna.distributions.FloatDistribution(gene.bounds.low, gene.bounds.high)
        for gene in genes
    }
    x0 = {f"{GENOME_KEY}/{gene.name}": gene.bounds.start for gene in genes} if settings.include_initial else None
    sigma0 = settings.init_spread or settings.sigma * 2  # in Optuna's [0, 1]-scaled space: a fraction of each range
    sampler = optuna.samplers.CmaEsSampler(
        x0=x0,
        sigma0=sigma0,
        popsize=settings.population,
        seed=settings.seed,
        n_startup_trials=0,
        warn_independent_sampling=False,
    )
    searcher = OptunaSearch(space=distributions, sampler=sampler, metric=METRIC, mode=MODE, seed=settings.seed)
    # CMA-ES asks a generation at a time; never more candidates in flight than one generation.
    limited = OrdinalLimiter(
        searcher, max_concurrent=min(settings.population, settings.max_concurrent_trials or settings.population)
    )
    return tune.TuneConfig(
        metric=METRIC,
        mode=MODE,
        search_alg=limited,
        num_samples=settings.population * settings.generations,
        time_budget_s=settings.time_budget_s,
        reuse_actors=True,
    )
