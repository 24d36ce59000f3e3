"""The searches an Optuna sampler drives behind Ray Tune's ``OptunaSearch``: CMA-ES, multivariate TPE, random search
(the baseline with the same genome and candidate budget) and NSGA-II (multi-objective: one objective per fitness
dataset).

Each runs ``population x generations`` candidates, a generation at a time: a "generation" is ``population``
consecutive suggestions (config ``ordinal``), scored on the same rotating dev batch, and the next generation is
asked only once every candidate in flight is told, so that what a sampler has been told when it asks (hence what
it asks) never depends on which trial finished first: one seed gives one run.
"""

from __future__ import annotations

from typing import Any

from ray import tune
from ray.tune.search import ConcurrencyLimiter, Searcher

from evolution.config import SearchSettings
from evolution.genome import GenomeSpace
from evolution.objectives import METRIC, MODE, objective_keys
from evolution.racing import Racing, racing_of
from evolution.scoring import FitnessLedger
from evolution.trainable import CACHED_KEY, GENOME_KEY, ORDINAL_KEY, RUNG_CUTOFFS_KEY

OPTUNA_KINDS = frozenset({"cmaes", "tpe", "random", "nsga2"})


class OrdinalLimiter(ConcurrencyLimiter):
    """Numbers the suggested candidates (config ``ordinal``): generation = ordinal // population, so the
    candidates of one generation are scored on the same rotating dev batch. With ``space``, a suggested genome
    the run already scored is not scored again: its trial is told the recorded fitness (config ``cached``) and
    reports it without becoming a candidate. With ``racing`` (fidelity asha) each suggestion carries the rung
    cutoffs of everything told so far: in batch mode a generation is asked only after the previous one is told,
    so all of it races against the same bars."""

    _next_ordinal = 0

    def __init__(
        self,
        searcher: Searcher,
        max_concurrent: int,
        batch: bool = False,
        space: GenomeSpace | None = None,
        racing: Racing | None = None,
    ):
        super().__init__(searcher, max_concurrent=max_concurrent, batch=batch)
        self.ledger = FitnessLedger(space) if space is not None else None
        self.racing = racing

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        config = super().suggest(trial_id)
        if isinstance(config, dict):
            config = {**config, ORDINAL_KEY: self._next_ordinal}
            self._next_ordinal += 1
            if self.ledger is not None and not self.ledger.claim(config[GENOME_KEY]):
                known = self.ledger.lookup(config[GENOME_KEY])
                config[CACHED_KEY] = known.model_dump() if known is not None else None
            if self.racing is not None and self.ledger is not None:
                config[RUNG_CUTOFFS_KEY] = self.racing.cutoffs(self.ledger.rung_history())
        return config

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if self.ledger is not None and result:
            self.ledger.record_result(result)
        super().on_trial_complete(trial_id, result=result, error=error)


def _sampler(space: GenomeSpace, settings: SearchSettings, x0: dict[str, float] | None) -> Any:
    # lazy: only these searches need Optuna
    import optuna

    if settings.kind == "cmaes":
        return optuna.samplers.CmaEsSampler(
            x0=x0,
            # in Optuna's [0, 1]-scaled space: a fraction of each range
            sigma0=settings.init_spread or settings.sigma * 2,
            popsize=settings.population,
            seed=settings.seed,
            n_startup_trials=0,
            warn_independent_sampling=False,
        )
    if settings.kind == "tpe":
        # WHY multivariate: a merge method and its lambda are good together or not at all (TSV-M wants lambda ~2,
        # task arithmetic ~0.8), which independent per-gene densities cannot express. The first generation is
        # random (the startup trials); a generation is asked at once, so the trials in flight are given the worst
        # score seen (constant liar) and the sampler does not ask for the same point population times.
        return optuna.samplers.TPESampler(
            seed=settings.seed,
            n_startup_trials=settings.population,
            multivariate=True,
            constant_liar=True,
            warn_independent_sampling=False,
        )
    if settings.kind == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    if settings.kind == "nsga2":
        # Optuna's defaults otherwise (uniform crossover, mutation 1/genes); its first generation is random.
        return optuna.samplers.NSGAIISampler(population_size=settings.population, seed=settings.seed)
    raise ValueError(f"search kind {settings.kind!r} is not an Optuna search")


def optuna_tune_config(space: GenomeSpace, settings: SearchSettings, objectives: int = 1) -> tune.TuneConfig:
    """The TuneConfig of an Optuna-driven kind; NSGA-II maximises the ``objectives`` per-dataset scores."""
    # lazy: only these searches need Optuna
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    genes = space.genes()
    distributions: dict[str, optuna.distributions.BaseDistribution] = {
        f"{GENOME_KEY}/{gene.name}": optuna.distributions.FloatDistribution(gene.bounds.low, gene.bounds.high)
        for gene in genes
    }
    start = {f"{GENOME_KEY}/{gene.name}": gene.bounds.start for gene in genes}
    x0 = start if settings.include_initial and settings.kind == "cmaes" else None
    # The random and NSGA-II searches start from the init genome too (as PBT does): the first candidate.
    warm = [start] if settings.include_initial and settings.kind != "cmaes" else None
    metric: str | list[str] = METRIC
    mode: str | list[str] = MODE
    if settings.kind == "nsga2":
        metric, mode = objective_keys(objectives), [MODE] * objectives
    searcher = OptunaSearch(
        space=distributions,
        sampler=_sampler(space, settings, x0),
        metric=metric,
        mode=mode,
        points_to_evaluate=warm,
        seed=settings.seed,
    )
    limited = OrdinalLimiter(
        searcher,
        max_concurrent=min(settings.population, settings.max_concurrent_trials or settings.population),
        batch=True,
        space=space,
        racing=racing_of(settings),
    )
    return tune.TuneConfig(
        metric=METRIC,
        mode=MODE,
        search_alg=limited,
        num_samples=settings.population * settings.generations,
        time_budget_s=settings.time_budget_s,
        reuse_actors=True,
    )
