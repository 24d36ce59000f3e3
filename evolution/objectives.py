"""What a search maximises: one scalar ``fitness`` (the mean over the fitness datasets, signed so that higher is
better) or, for the multi-objective kind, one objective per dataset; and the Pareto front of the latter.

Why ``objective_<i>`` keys and not dataset ids: Tune flattens nested result keys on ``/`` and Optuna's searcher
reads each objective as a top-level result key, while dataset ids may contain ``/``. Objective ``i`` is the
``i``-th fitness dataset of the request, signed like ``fitness``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from alloy.wire_evolution import ParetoMember

METRIC = "fitness"
MODE = "max"
OBJECTIVE_PREFIX = "objective_"
MAX_FRONT = 32  # front members re-scored on the whole dev split at the end (the best by fitness first)


def objective_keys(count: int) -> list[str]:
    return [f"{OBJECTIVE_PREFIX}{index}" for index in range(count)]


def objectives_of(metrics: Mapping[str, float], dataset_ids: Sequence[str], sign: float) -> dict[str, float]:
    """The per-dataset objectives of one scored candidate (higher is better, like ``fitness``)."""
    return {key: sign * float(metrics[d]) for key, d in zip(objective_keys(len(dataset_ids)), dataset_ids)}


def objectives_in(result: Mapping[str, Any]) -> dict[str, float]:
    """The objectives a trial reported."""
    return {key: float(value) for key, value in result.items() if key.startswith(OBJECTIVE_PREFIX)}


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """``a`` is at least as good as ``b`` on every objective and better on one (all maximised)."""
    return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))


def pareto_indices(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the non-dominated points (the first of equal points only: a front lists each trade-off once)."""
    front: list[int] = []
    for i, point in enumerate(points):
        if any(dominates(other, point) for other in points):
            continue
        if any(list(points[j]) == list(point) for j in front):
            continue
        front.append(i)
    return front


def front_of(members: Sequence[ParetoMember], dataset_ids: Sequence[str], sign: float) -> list[ParetoMember]:
    """The non-dominated members, best fitness first."""
    points = [[sign * m.scores[d] for d in dataset_ids] for m in members]
    chosen = [members[i] for i in pareto_indices(points)]
    return sorted(chosen, key=lambda m: (-m.fitness, m.candidate_id))
