"""Successive halving on dev subsets (``search.fidelity: asha``): cheaper fitness without a noisier winner.

A candidate is scored on rung 0, a small seeded subset of each dev set; it goes on to rung ``k + 1`` (a superset,
``reduction_factor`` times larger) only while its score is not below the rung's cutoff; the last rung is the whole
dev split, so every candidate that reaches it has the same fitness as under ``fidelity: fixed`` with the whole
split, and only those can be selected (an earlier rotating 48-example window lost to the grid: its noise exceeded
the differences the search ranks).

The cutoff is the rule of Ray Tune's ``ASHAScheduler`` (stopping variant): the ``1 - 1/reduction_factor`` quantile
(linear interpolation, as ``numpy.percentile``) of the scores recorded at that rung. Ray's scheduler compares with
whatever reported before, which depends on which trial finished first; here the records are those of the earlier
generations only, handed to the trial by the driver with its genome (config ``rung_cutoffs``), so every candidate
of one generation races against the same bars and one seed gives one run. The first generation has no records and
is scored on the whole split.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel, Field

from evolution.config import SearchSettings

Batch = dict[str, list[int] | None] | None  # dataset id -> example indices (None: all of it); None: every dataset


class Racing(BaseModel):
    """The rung schedule of one run."""

    rungs: int = Field(3, ge=2)
    reduction_factor: int = Field(3, ge=2)
    seed: int = 0

    def fraction(self, rung: int) -> float:
        """The share of each dev set scored at ``rung`` (1.0 at the last)."""
        return float(self.reduction_factor) ** -(self.rungs - 1 - rung)

    def batches(self, sizes: Mapping[str, int]) -> list[Batch]:
        """Each rung's examples: nested prefixes of one seeded permutation per dataset; the last rung is None
        (the whole split, scored exactly as the fixed fidelity scores it)."""
        orders = {}
        for dataset_id, size in sizes.items():
            order = list(range(size))
            random.Random(f"rungs:{self.seed}:{dataset_id}").shuffle(order)
            orders[dataset_id] = order
        out: list[Batch] = []
        for rung in range(self.rungs - 1):
            out.append(
                {
                    dataset_id: sorted(order[: max(1, math.ceil(len(order) * self.fraction(rung)))])
                    for dataset_id, order in orders.items()
                }
            )
        out.append(None)
        return out

    def cutoffs(self, recorded: Sequence[Sequence[float]]) -> list[float | None]:
        """The bar of every rung but the last, from the rung scores of earlier candidates (each the list of the
        scores one candidate reached, rung 0 first)."""
        return [
            rung_cutoff([scores[rung] for scores in recorded if len(scores) > rung], self.reduction_factor)
            for rung in range(self.rungs - 1)
        ]


def rung_cutoff(scores: Sequence[float], reduction_factor: int) -> float | None:
    """The ``1 - 1/reduction_factor`` quantile of ``scores`` (None when there are none: everyone goes on)."""
    values = sorted(s for s in scores if not math.isnan(s))
    if not values:
        return None
    position = (1.0 - 1.0 / reduction_factor) * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def race(score_at: Callable[[int], float], cutoffs: Sequence[float | None], rungs: int) -> list[float]:
    """Score rung after rung while the candidate clears each bar (a score below the cutoff stops it, as in
    Ray's ASHA; a tie goes on); the scores of the rungs it reached."""
    scores = []
    for rung in range(rungs):
        scores.append(score_at(rung))
        cutoff = cutoffs[rung] if rung < len(cutoffs) else None
        if rung < rungs - 1 and cutoff is not None and scores[-1] < cutoff:
            break
    return scores


def racing_of(settings: SearchSettings) -> Racing | None:
    """The rung schedule of a search (None unless ``fidelity: asha``)."""
    if settings.fidelity != "asha":
        return None
    return Racing(rungs=settings.rungs, reduction_factor=settings.reduction_factor, seed=settings.seed)
