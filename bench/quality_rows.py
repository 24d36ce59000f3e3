"""The rows of the merge-quality table (bench/merge_quality.py): merging a model family in memory with Alloy's
own merge code, scoring each merged model, and printing and picking rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from alloy.evaluation.candidate import CandidateEvaluator
from alloy.evaluation.dataset_sources import LocalDatasets
from alloy.merge.recipe import MergeRecipe
from alloy.model_manifest import weight_files
from alloy.zoo.manifest import ModelEntry, PresetManifest


@dataclass
class Row:
    name: str
    family: str  # base | fine-tune | average | task_arithmetic | ties | dare
    recipe: MergeRecipe | None = None
    model_id: str | None = None
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # split -> dataset -> value


def load_state_dict(entry: ModelEntry) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in weight_files(entry.path):
        state.update(load_file(str(entry.path / shard)))
    return state


def merge_rows(
    base_id: str,
    tune_ids: list[str],
    lambdas: list[float],
    densities: list[float],
    ties_lambdas: list[float],
    dare_drop: float,
    dare_lambdas: list[float],
) -> list[Row]:
    rows = [
        Row(
            "uniform average",
            "average",
            MergeRecipe(strategy="task_arithmetic", variant="linear", models=[{"model": m} for m in tune_ids]),
        )
    ]
    for lam in lambdas:
        rows.append(
            Row(
                f"task arithmetic λ={lam:g}",
                "task_arithmetic",
                MergeRecipe(
                    strategy="task_arithmetic",
                    base_model=base_id,
                    models=[{"model": m} for m in tune_ids],
                    parameters={"lambda": lam},
                ),
            )
        )
    for density in densities:
        for lam in ties_lambdas:
            rows.append(
                Row(
                    f"TIES keep {density:.0%} λ={lam:g}",
                    "ties",
                    MergeRecipe(
                        strategy="ties",
                        base_model=base_id,
                        models=[{"model": m, "parameters": {"density": density}} for m in tune_ids],
                        parameters={"lambda": lam},
                    ),
                )
            )
    for lam in dare_lambdas:
        rows.append(
            Row(
                f"DARE drop {dare_drop:.0%} + TA λ={lam:g}",
                "dare",
                MergeRecipe(
                    strategy="dare",
                    base_model=base_id,
                    models=[{"model": m, "parameters": {"drop_rate": dare_drop}} for m in tune_ids],
                    parameters={"lambda": lam},
                    seed=0,
                ),
            )
        )
    return rows


class Scorer:
    def __init__(
        self, manifest: PresetManifest, base: ModelEntry, dataset_ids: list[str], splits: list[str], batch_size: int
    ):
        source = LocalDatasets(manifest.datasets)
        started = time.perf_counter()
        self.evaluators = {
            s: CandidateEvaluator(base.path, source, dataset_ids, s, batch_size=batch_size) for s in splits
        }
        self.setup_seconds = time.perf_counter() - started
        self.seconds: dict[str, float] = {s: 0.0 for s in splits}
        self.evaluations = 0

    def score(
        self, state: dict[str, torch.Tensor], only: list[str] | None = None, splits: list[str] | None = None
    ) -> dict[str, dict[str, float]]:
        """Scores per split and dataset; ``only`` restricts the datasets, ``splits`` the splits."""
        out = {}
        for split, evaluator in self.evaluators.items():
            if splits is not None and split not in splits:
                continue
            started = time.perf_counter()
            subset = None
            if only is not None:  # datasets not asked for get an empty selection
                subset = {
                    d.dataset_id: (list(range(len(d))) if d.dataset_id in only else []) for d in evaluator.datasets
                }
            scores = evaluator.score(state, subset)
            out[split] = {d: scores[d] for d in evaluator.dataset_ids if only is None or d in only}
            self.seconds[split] += time.perf_counter() - started
            self.evaluations += 1
        return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def fmt(value: float, percent: bool) -> str:
    return f"{100 * value:.1f}" if percent else f"{value:.2f}"


def print_table(rows: list[Row], datasets: list[str], splits: list[str], percent: bool, short: dict[str, str]) -> None:
    eval_split = splits[-1]
    header = ["model"] + [f"{short[d]} ({eval_split})" for d in datasets] + [f"avg {s}" for s in splits]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row.name] + [fmt(row.scores[eval_split][d], percent) for d in datasets]
        cells += [fmt(mean(row.scores[s].values()), percent) for s in splits]
        print("| " + " | ".join(cells) + " |")


def best(rows: list[Row], family: str, split: str, higher: bool) -> Row:
    candidates = [r for r in rows if r.family == family]
    key = lambda r: mean(r.scores[split].values())  # noqa: E731
    return max(candidates, key=key) if higher else min(candidates, key=key)
