"""Ray Tune search over genomes: population-based training (exploit a top genome, explore by perturbing it), or one
of the Optuna-sampled kinds (CMA-ES, random search, NSGA-II: :mod:`evolution.sampled`), behind one
``build_tune_config``.

Everything handed to Tune here is picklable plain data (Tune stores the scheduler, searcher, stopper and
callbacks in the experiment folder so that ``Tuner.restore`` can continue a run after a forced shutdown).
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ray import tune
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler
from ray.tune.stopper import Stopper

from evolution.config import SearchSettings
from evolution.genome import Genome, GenomeSpace
from evolution.objectives import METRIC, MODE
from evolution.racing import Racing, racing_of
from evolution.sampled import optuna_tune_config
from evolution.scoring import FitnessLedger
from evolution.trainable import CACHED_KEY, GENOME_KEY, LINEAGE_KEY, RUNG_CUTOFFS_KEY


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
        config[GENOME_KEY] = self.perturb(config[GENOME_KEY])
        return config

    def perturb(self, genome: Genome) -> Genome:
        return self.space.perturb(genome, self.rng, self.sigma, self.resample_probability)


# A fresh genome is drawn this many times before a repeat is accepted (then reported from the ledger, unscored):
# only a tiny discrete space (a few franken slots, every gene clipped at a bound) runs out of fresh neighbours.
FRESH_TRIES = 32


@contextmanager
def _seeded_pbt_random(rng: random.Random) -> Iterator[None]:
    """Ray's PBT draws its donors (and its built-in explore) from Python's global ``random``, which nothing
    seeds: for the length of one scheduler call, its module sees this scheduler's own seeded generator instead.
    The scheduler runs on the driver's one control thread, so no other user of ``random`` sees the swap."""
    from ray.tune.schedulers import pbt

    saved = pbt.random
    pbt.random = rng  # type: ignore[assignment]  # a seeded Random stands in for the module (PBT calls its functions)
    try:
        yield
    finally:
        pbt.random = saved


class GenomePBT(PopulationBasedTraining):
    """PBT whose exploit also hands the donor's lineage (its last candidate and generation) to the recipient
    through the config, taken from the donor's last reported *result*: the recipient then needs nothing from
    the donor's checkpoint files, which Tune may already have rotated away.

    Its clock is the candidate's ``generation`` (``time_attr``), not Tune's ``training_iteration``: a restored trial
    re-runs the generation of its checkpoint and an exploited one continues its donor's generation, so iteration
    counts drift apart between trials while generations stay comparable. ``on_trial_result`` also keeps the
    synchronous rounds sound after ``Tuner.restore``.

    Every candidate is a new genome (given ``space``): a genome does not train, so PBT's "continue" would only
    score the same genome again. In each synchronous round every trial that is not exploited takes a mutation
    step from the genome it just scored, an exploited one perturbs its donor's last scored genome (the donor's
    config may already hold the donor's next step), and both draw until the genome is one the run has never
    handed out (:class:`FitnessLedger`). Donors are drawn from the scheduler's own generator seeded by ``seed``
    (Ray's PBT uses the unseeded global ``random``), so one seed gives one run.

    With ``racing`` (fidelity asha) every next genome carries the rung cutoffs of everything scored so far: the
    round runs once every trial of the generation has reported, so all of the next generation race against the
    same bars."""

    def __init__(
        self,
        *,
        space: GenomeSpace | None = None,
        explorer: GenomeExplorer | None = None,
        seed: int = 0,
        racing: Racing | None = None,
        **kwargs,
    ):
        if explorer is not None:
            kwargs.setdefault("custom_explore_fn", explorer)
        super().__init__(**kwargs)
        self._explorer = explorer
        self._racing = racing
        self._ledger = FitnessLedger(space) if space is not None else None
        self._rng = random.Random(f"pbt-donors:{seed}")
        self._exploited: set[str] = set()  # trial ids exploited in the current round

    def on_trial_add(self, tune_controller, trial):
        super().on_trial_add(tune_controller, trial)
        if self._ledger is not None:
            self._ledger.claim(trial.config[GENOME_KEY])  # the initial population is handed out

    def on_trial_result(self, tune_controller, trial, result):
        if self._ledger is not None:
            self._ledger.record_result(result)
        with _seeded_pbt_random(self._rng):
            return self._on_trial_result(tune_controller, trial, result)

    def _on_trial_result(self, tune_controller, trial, result):
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

    def _checkpoint_or_exploit(self, trial, tune_controller, upper_quantile, lower_quantile):
        super()._checkpoint_or_exploit(trial, tune_controller, upper_quantile, lower_quantile)
        if self._ledger is None:
            return
        if trial.trial_id in self._exploited:
            self._exploited.discard(trial.trial_id)
            return
        # Not exploited (top, middle, or a bottom trial whose donor had no checkpoint): a step of its own.
        scored = self._scored_genome(self._trial_state[trial].last_result, trial.config)
        config = copy.deepcopy(trial.config)
        config[GENOME_KEY], config[CACHED_KEY] = self._fresh(scored)
        config[RUNG_CUTOFFS_KEY] = self._cutoffs()
        trial.set_config(config)

    def _get_new_config(self, trial, trial_to_clone):
        donor_result = self._trial_state[trial_to_clone].last_result or {}
        if self._ledger is None:
            new_config, operations = super()._get_new_config(trial, trial_to_clone)
        else:
            self._exploited.add(trial.trial_id)
            new_config, operations = copy.deepcopy(trial_to_clone.config), {}
            scored = self._scored_genome(donor_result, trial_to_clone.config)
            new_config[GENOME_KEY], new_config[CACHED_KEY] = self._fresh(scored)
            new_config[RUNG_CUTOFFS_KEY] = self._cutoffs()
        new_config[LINEAGE_KEY] = {
            "trial_id": trial_to_clone.trial_id,
            "candidate_id": donor_result.get("candidate_id") or donor_result.get("repeat_of"),
            "generation": int(donor_result.get("generation", 0)),
        }
        return new_config, operations

    def _cutoffs(self) -> list[float | None]:
        if self._racing is None or self._ledger is None:
            return []
        return self._racing.cutoffs(self._ledger.rung_history())

    @staticmethod
    def _scored_genome(result: dict[str, Any] | None, config: dict[str, Any]) -> Genome:
        """The genome behind a trial's last result (its config may already name its next one)."""
        if result and result.get("genome_json"):
            return json.loads(result["genome_json"])
        return dict(config[GENOME_KEY])

    def _fresh(self, genome: Genome) -> tuple[Genome, dict[str, Any] | None]:
        """A mutation of ``genome`` never handed out before, and ``None``; or, when :data:`FRESH_TRIES` draws
        found none, the last draw and what the ledger knows of it (the trial then reports that, unscored)."""
        assert self._explorer is not None and self._ledger is not None  # only a scheduler given a space steps
        for _ in range(FRESH_TRIES):
            child = self._explorer.perturb(genome)
            if self._ledger.claim(child):
                return child, None
        known = self._ledger.lookup(child)
        return child, known.model_dump() if known is not None else None


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
        # A candidate stopped on a dev subset (fidelity asha) only estimated its fitness: it reaches nothing.
        estimate = "rung" in result and not result.get("full_dev")
        if (
            self.target_fitness is not None
            and not estimate
            and result.get(METRIC, float("-inf")) >= self.target_fitness
        ):
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


def build_tune_config(
    space: GenomeSpace, settings: SearchSettings, objectives: int = 1
) -> tuple[tune.TuneConfig, dict[str, Any]]:
    """The TuneConfig and param space of one search kind (``objectives``: the fitness datasets, each one
    objective of the multi-objective kind)."""
    if settings.kind == "pbt":
        scheduler = GenomePBT(
            space=space,
            seed=settings.seed,
            racing=racing_of(settings),
            explorer=GenomeExplorer(space, settings.sigma, settings.resample_probability, settings.seed),
            time_attr="generation",  # see GenomePBT
            perturbation_interval=1,  # one exploit/explore round per generation
            quantile_fraction=settings.quantile_fraction,
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
    return optuna_tune_config(space, settings, objectives), {}
