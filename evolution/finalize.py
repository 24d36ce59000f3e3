"""After the search: choose the winner fairly, write it once to disk, and draw the fitness curve.

Candidates were ranked on small rotating dev batches, so the winner is not simply the highest single score: the
distinct genomes with the best mean batch fitness (``finalists``) are re-scored on the whole dev split and the best
of those wins; the search's starting genome is always among them, so an evolution never returns a recipe that
scores below its starting point on the whole dev split (a second stage that starts at an earlier winner, as PS+DFS
does, keeps it unless it finds better). Only then is one model merged to disk.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from evolution.tracking import Candidate


class Finalist(BaseModel):
    candidate: Candidate  # its latest evaluation
    mean_batch_fitness: float
    evaluations: int
    dev_fitness: float | None = None
    dev_metrics: dict[str, float] = {}


def finalists(candidates: list[Candidate], count: int, keep: dict[str, float] | None = None) -> list[Finalist]:
    """The ``count`` distinct genomes with the highest mean fitness over the batches they were scored on, plus the
    genome ``keep`` (the search's starting genome) when it competes and is not among them. WHY ``keep``: on small
    rotating batches a lucky neighbour can outrank the starting genome and then score below it on the whole dev
    split (seen in PS+DFS on causal-lm with 4-example batches and one finalist: the second stage returned a worse
    model than the first stage's winner it started from). When some candidates reached the whole dev split and
    others were stopped on a subset (fidelity asha), only the former compete: a stopped candidate's estimate may be
    high by luck, and is never ranked against full-dev scores."""
    by_genome: dict[str, list[Candidate]] = defaultdict(list)
    full_dev = [c for c in candidates if c.metrics.get("full_dev")]
    for candidate in full_dev or candidates:
        by_genome[_genome_key(candidate.genome)].append(candidate)
    ranked = sorted(
        (
            Finalist(
                candidate=max(group, key=lambda c: c.generation),
                mean_batch_fitness=statistics.fmean(c.fitness for c in group),
                evaluations=len(group),
            )
            for group in by_genome.values()
        ),
        key=lambda f: f.mean_batch_fitness,
        reverse=True,
    )
    chosen = ranked[:count]
    if keep is not None:
        kept = _genome_key(keep)
        if all(_genome_key(f.candidate.genome) != kept for f in chosen):
            chosen += [f for f in ranked[count:] if _genome_key(f.candidate.genome) == kept]
    return chosen


def _genome_key(genome: dict[str, float]) -> str:
    return ",".join(f"{name}={value:.6g}" for name, value in sorted(genome.items()))


def lineage_of(candidate_id: str, candidates: list[Candidate], limit: int = 1000) -> list[str]:
    """The chain of candidate ids from ``candidate_id`` back to a member of the initial population."""
    parents = {c.candidate_id: c.parent_candidate for c in candidates}
    chain = [candidate_id]
    while (parent := parents.get(chain[-1])) and len(chain) < limit:
        chain.append(parent)
    return chain


def fitness_by_generation(candidates: list[Candidate]) -> dict[int, list[float]]:
    table: dict[int, list[float]] = defaultdict(list)
    for candidate in candidates:
        table[candidate.generation].append(candidate.fitness)
    return dict(sorted(table.items()))


def plot_fitness(
    candidates: list[Candidate], path: str | Path, *, title: str, reference_lines: dict[str, float] | None = None
) -> Path:
    """PNG: best, median and worst dev-batch fitness per generation (plus optional reference levels)."""
    # lazy: only the fitness plot needs matplotlib
    import matplotlib

    matplotlib.use("Agg")  # no display in a Serve replica or a job driver
    # lazy: only the fitness plot needs matplotlib
    import matplotlib.pyplot as plt

    table = fitness_by_generation(candidates)
    generations = list(table)
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if generations:
        axes.plot(generations, [max(v) for v in table.values()], marker="o", label="best")
        axes.plot(generations, [statistics.median(v) for v in table.values()], marker=".", label="median")
        axes.plot(generations, [min(v) for v in table.values()], linestyle=":", label="worst")
    for label, level in (reference_lines or {}).items():
        axes.axhline(level, linestyle="--", linewidth=0.8, color="grey")
        axes.annotate(label, (generations[0] if generations else 0, level), fontsize=7, va="bottom")
    axes.set_xlabel("generation")
    axes.set_ylabel("fitness (dev batch)")
    axes.set_title(title)
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path
