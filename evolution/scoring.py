"""Fitness of a candidate: Alloy's ``CandidateEvaluator`` on the dev split, built once per worker process.

The fitness data (tables, task dicts, prototype heads) is read once by the driver and travels to the trials
through the object store with the parents (:class:`InMemoryDatasets`), so trials need no database or artifact
store access. The evaluator's model skeleton is loaded from ``model_dir`` (a local folder of the base model).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field

from alloy.errors import not_found, validation_failed
from alloy.evaluation.candidate import CandidateEvaluator
from evolution.objectives import objectives_in


class InMemoryDatasets:
    """A ``DatasetSource`` over splits already loaded by the driver (picklable: arrow tables and tensors)."""

    def __init__(self, splits: Mapping[tuple[str, str], Any]):
        self.splits = dict(splits)

    @classmethod
    def read(cls, source, dataset_ids: Sequence[str], splits: Sequence[str]) -> InMemoryDatasets:
        return cls(
            {(dataset_id, split): source.load(dataset_id, split) for dataset_id in dataset_ids for split in splits}
        )

    def load(self, dataset_id: str, split: str):
        try:
            return self.splits[(dataset_id, split)]
        except KeyError:
            raise not_found("dataset split", f"{dataset_id}:{split}") from None


class ScorerSpec(BaseModel):
    """How to build the evaluator of one split."""

    run: str = Field("", description="the evolution it serves: part of the per-process cache key")
    model_dir: str
    dataset_ids: list[str] = Field(min_length=1)
    split: str = "dev"
    batch_size: int = Field(32, ge=1)


class CandidateScorer:
    """``score(state_dict, batch_indices) -> metrics`` with a ``fitness`` key (higher is better)."""

    def __init__(self, spec: ScorerSpec, data):
        self.spec = spec
        self.evaluator = CandidateEvaluator(
            spec.model_dir, data, spec.dataset_ids, spec.split, batch_size=spec.batch_size
        )
        directions = self.evaluator.metric_directions()
        metrics = {dataset.metric for dataset in self.evaluator.datasets}
        if len(metrics) != 1:
            raise validation_failed("evolution fitness needs datasets of one metric", metrics=sorted(metrics))
        self.metric = metrics.pop()
        self.sign = 1.0 if all(directions.values()) else -1.0

    @property
    def sizes(self) -> dict[str, int]:
        return {dataset.dataset_id: len(dataset) for dataset in self.evaluator.datasets}

    def score(self, state_dict, batch_indices: Mapping[str, Sequence[int] | None] | None = None) -> dict[str, float]:
        return self._with_fitness(self.evaluator.score(state_dict, batch_indices))

    def score_loaded(self, batch_indices: Mapping[str, Sequence[int] | None] | None = None) -> dict[str, float]:
        """Score the weights the last ``score`` loaded again, on other examples (the next rung of a race): loading
        a state dict into the skeleton costs more than scoring a small subset."""
        return self._with_fitness(self.evaluator.score_loaded(batch_indices))

    def _with_fitness(self, metrics: dict[str, float]) -> dict[str, float]:
        # fitness: the mean over datasets, signed so that higher is better (perplexity is negated)
        return {**metrics, "fitness": self.sign * metrics[f"mean_{self.metric}"]}


_SCORERS: dict[str, CandidateScorer] = {}
_LOCK = threading.Lock()


def cached_scorer(spec: ScorerSpec, data) -> CandidateScorer:
    """One evaluator per worker process and spec: the skeleton and the tokenised data outlive a trial, because
    Tune reuses trial actors across PBT exploits."""
    key = spec.model_dump_json()
    with _LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = _SCORERS[key] = CandidateScorer(spec, data)
        return scorer


# --- one fitness per genome ------------------------------------------------------------------------------------


def genome_key(space, genome: Mapping[str, float]) -> str:
    """A genome's identity: the recipe it decodes to, as canonical JSON. Two genomes that merge the same recipe
    (genes equal to the decoder's 6 decimals, or franken genes flooring to the same slices) are one genome."""
    return json.dumps(space.decode_dict(dict(genome)), sort_keys=True, separators=(",", ":"))


class FitnessRecord(BaseModel):
    """The fitness a genome scored, and the candidate that scored it (what a repeat reports instead)."""

    candidate_id: str
    fitness: float
    objectives: dict[str, float] = {}  # the per-dataset objectives it reported (the multi-objective kind reads them)
    # Scored on the whole dev split? False for a rotating batch or a rung below the last (fidelity asha): such a
    # fitness is an estimate, and a repeat reports it as one (never as a full-dev score).
    full_dev: bool = False
    rung_scores: list[float] = []  # fidelity asha: the score of every rung it reached, rung 0 first


class FitnessLedger:
    """Every genome the search has handed out or scored, keyed by :func:`genome_key`. Kept by the driver-side
    search objects (PBT scheduler, CMA-ES limiter), which see every genome before a trial runs it and every
    result after: they hand out only unseen genomes and tell a trial that must repeat one the fitness it
    scored (config ``cached``), so a repeat is never scored or recorded twice. Plain data: Tune pickles it."""

    def __init__(self, space):
        self.space = space
        self.planned: set[str] = set()
        self.records: dict[str, FitnessRecord] = {}

    def key(self, genome: Mapping[str, float]) -> str:
        return genome_key(self.space, genome)

    def claim(self, genome: Mapping[str, float]) -> bool:
        """True (and remembered) when the genome is new; False when it was handed out or scored before."""
        key = self.key(genome)
        if key in self.planned or key in self.records:
            return False
        self.planned.add(key)
        return True

    def lookup(self, genome: Mapping[str, float]) -> FitnessRecord | None:
        return self.records.get(self.key(genome))

    def record(
        self,
        genome: Mapping[str, float],
        candidate_id: str,
        fitness: float,
        objectives: Mapping[str, float] | None = None,
        *,
        full_dev: bool = False,
        rung_scores: Sequence[float] = (),
    ) -> None:
        key = self.key(genome)
        self.planned.discard(key)
        record = FitnessRecord(
            candidate_id=candidate_id,
            fitness=fitness,
            objectives=dict(objectives or {}),
            full_dev=full_dev,
            rung_scores=list(rung_scores),
        )
        known = self.records.get(key)
        if known is None or (record.full_dev and not known.full_dev):  # a full-dev score outranks an estimate
            self.records[key] = record

    def record_result(self, result: Mapping[str, Any]) -> None:
        """Remember a trial's reported candidate (results of repeats carry no ``candidate_id``)."""
        if result.get("candidate_id") and result.get("genome_json"):
            genome = json.loads(result["genome_json"])
            self.record(
                genome,
                result["candidate_id"],
                float(result["fitness"]),
                objectives_in(result),
                full_dev=bool(result.get("full_dev", False)),
                rung_scores=json.loads(result.get("rung_scores_json") or "[]"),
            )

    def full_dev_fitness(self, genome: Mapping[str, float]) -> float | None:
        """The genome's fitness on the whole dev split, or None when it has none (unscored, or only estimated)."""
        record = self.lookup(genome)
        return record.fitness if record is not None and record.full_dev else None

    def rung_history(self) -> list[list[float]]:
        """The rung scores of every genome scored so far (fidelity asha), in a fixed order: the cutoffs of the
        next generation are computed from them."""
        return [list(self.records[key].rung_scores) for key in sorted(self.records) if self.records[key].rung_scores]
