"""The end of an evolution, and what can follow it: the finalists re-scored on the whole dev split, the winner
merged once to disk, registered with its lineage and scored on the test split next to every parent; for the
multi-objective kind the Pareto front re-scored on the whole dev split; and the promotion of any front member to
a registered model (merged, registered, scored on test once, like the winner).
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from alloy.errors import AlloyError, ErrorCode, not_found
from alloy.merge.executor import execute_merge, merge_state_dicts
from alloy.merge.recipe import MergeRecipe
from alloy.registry.models import ModelRecord, ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.tracker import ExperimentTracker
from evolution.config import EvolutionSpec
from evolution.finalize import Finalist, finalists, lineage_of, plot_fitness
from evolution.genome import GenomeSpace
from evolution.inputs import ResolvedInputs, skeleton_dir
from evolution.objectives import MAX_FRONT, ParetoMember, front_of
from evolution.parents import ParentArrays, as_tensors, load_state_dict_arrays
from evolution.runner import SearchOutcome
from evolution.scoring import CandidateScorer, InMemoryDatasets, ScorerSpec, genome_key
from evolution.tracking import Candidate

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "tokenizer.model",
    "merges.txt",
    "vocab.json",
)


def default_output_id(job_id: str) -> str:
    return f"evolved-{job_id[:24]}"


class Conclusion:
    """The end of one evolution job (and later promotions of its front members)."""

    def __init__(
        self,
        *,
        storage_path: Path,
        device: str,
        models: ModelRegistry,
        tracker: ExperimentTracker,
        store: ArtifactStore | None,
        spec: EvolutionSpec,
        inputs: ResolvedInputs,
        space: GenomeSpace,
        parents: ParentArrays,
    ):
        self.storage_path = storage_path
        self.device = device
        self.models = models
        self.tracker = tracker
        self.store = store
        self.spec = spec
        self.inputs = inputs
        self.space = space
        self.tensors = as_tensors(parents)
        self.skeleton = str(skeleton_dir(inputs))
        splits = [spec.dev_split, spec.test_split]
        self.data = InMemoryDatasets.read(inputs.source, inputs.dataset_ids, splits)

    def scorer(self, split: str) -> CandidateScorer:
        return CandidateScorer(
            ScorerSpec(model_dir=self.skeleton, dataset_ids=self.inputs.dataset_ids, split=split), self.data
        )

    # ---- one model on disk, registered, tested ---------------------------------------------------------------
    def publish(self, recipe: MergeRecipe, out_dir: Path, model_id: str, lineage: dict[str, Any]) -> ModelRecord | None:
        """Merge ``recipe`` to ``out_dir`` and register it as ``model_id`` (None: the id was registered already,
        by an earlier attempt of this job)."""
        if out_dir.exists():  # a replay that died while finalizing
            shutil.rmtree(out_dir)
        parents = {m: Path(p) for m, p in self.inputs.parents.items()}
        execute_merge(recipe, parents, out_dir, device=self.device)
        for name in TOKENIZER_FILES:  # the merged folder must be loadable on its own (evaluation needs them)
            if (Path(self.skeleton) / name).exists() and not (out_dir / name).exists():
                shutil.copy2(Path(self.skeleton) / name, out_dir / name)
        if self.models.exists(model_id):
            return None
        return self.models.register(model_id, str(out_dir), lineage=lineage)

    def test_scores(self, experiment_id: str, models: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Each model scored once on the test split, logged to the tracker."""
        test = self.scorer(self.spec.test_split)
        scores = {model_id: test.evaluator.score(tensors) for model_id, tensors in models.items()}
        for scored_model, metrics in scores.items():
            for dataset_id, value in metrics.items():
                mean = dataset_id.startswith("mean_")
                self.tracker.log_result(
                    experiment_id,
                    scored_model,
                    None if mean else dataset_id,
                    self.spec.test_split,
                    dataset_id if mean else test.metric,
                    float(value),
                )
        return {"metric": f"mean_{test.metric}", "sign": test.sign, "per_dataset": scores}

    def lineage(self, job_id: str, experiment_id: str, candidate_id: str, chain: list[str], recipe: MergeRecipe):
        return {
            "kind": "evolution",
            "job_id": job_id,
            "experiment_id": experiment_id,
            "trial_id": candidate_id,
            "lineage": chain,
            "parents": self.space.models,
            "base_model": self.space.base_model,
            "recipe": recipe.model_dump(mode="json", exclude_none=True),
            "search": self.spec.search.kind,
        }

    # ---- the winner ------------------------------------------------------------------------------------------
    def finalize(
        self, job_id: str, experiment_id: str, candidates: list[Candidate], outcome: SearchOutcome
    ) -> dict[str, Any]:
        started = time.perf_counter()
        spec, space = self.spec, self.space
        dev = self.scorer(spec.dev_split)
        start = space.initial() if spec.search.include_initial else None  # the seed individual: always a finalist
        chosen: list[Finalist] = finalists(candidates, spec.search.finalists, keep=start)
        for finalist in chosen:
            merged = merge_state_dicts(space.decode(finalist.candidate.genome), self.tensors, device=self.device)
            finalist.dev_metrics = dev.score(merged)
            finalist.dev_fitness = finalist.dev_metrics["fitness"]
        winner = max(chosen, key=lambda f: f.dev_fitness if f.dev_fitness is not None else float("-inf"))
        recipe = space.decode(winner.candidate.genome)
        model_id = spec.output_model_id or default_output_id(job_id)
        chain = lineage_of(winner.candidate.candidate_id, candidates)
        lineage = self.lineage(job_id, experiment_id, winner.candidate.candidate_id, chain, recipe)
        out_dir = self.storage_path / job_id / "model"
        self.publish(recipe, out_dir, model_id, lineage)
        scored = {model_id: _load_dir_tensors(out_dir), **{m: self.tensors[m] for m in space.models}}
        if space.base_model:
            scored[space.base_model] = self.tensors[space.base_model]
        test = self.test_scores(experiment_id, scored)
        mean_key, sign, per_dataset = test["metric"], test["sign"], test["per_dataset"]
        best_parent = max(space.models, key=lambda m: sign * per_dataset[m][mean_key])
        evolved_test = per_dataset[model_id][mean_key]
        front = self.pareto_front(candidates, dev) if spec.search.kind == "nsga2" else None
        return {
            "model_id": model_id,
            "experiment_id": experiment_id,
            "best_trial": winner.candidate.candidate_id,
            "lineage": chain,
            "recipe": lineage["recipe"],
            "genome": winner.candidate.genome,
            "dev_fitness": winner.dev_fitness,
            "finalists": [
                {
                    "trial": f.candidate.candidate_id,
                    "mean_batch_fitness": f.mean_batch_fitness,
                    "evaluations": f.evaluations,
                    "dev_fitness": f.dev_fitness,
                }
                for f in chosen
            ],
            "pareto_front": [m.model_dump(mode="json") for m in front] if front is not None else None,
            "test": {
                "metric": mean_key,
                "scores": {m: s[mean_key] for m, s in per_dataset.items()},
                "per_dataset": per_dataset,
                "best_parent": best_parent,
                "beats_every_parent": all(sign * evolved_test > sign * per_dataset[m][mean_key] for m in space.models),
            },
            "fitness_plot": self.store_plot(job_id, candidates),
            "search": {
                "kind": spec.search.kind,
                "population": spec.search.population,
                "generations": spec.search.generations,
                "candidates": len(candidates),
                "evaluated_this_run": len(outcome.candidates),
                "resumed": outcome.resumed,
                "search_wall_s": round(outcome.wall_s, 2),
                "candidates_per_minute": round(len(outcome.candidates) / max(outcome.wall_s, 1e-9) * 60, 2),
                "errored_trials": outcome.errored_trials,
            },
            "finalize_s": round(time.perf_counter() - started, 2),
        }

    # ---- the Pareto front ------------------------------------------------------------------------------------
    def pareto_front(self, candidates: list[Candidate], dev: CandidateScorer) -> list[ParetoMember]:
        """The non-dominated candidates by per-dataset dev score. Candidates of different generations were scored
        on different dev batches, so the front of the batch scores only nominates: its members (at most
        :data:`MAX_FRONT`, best fitness first) are re-scored on the whole dev split and the front is taken again."""
        ids = self.inputs.dataset_ids
        nominated: dict[str, Candidate] = {}
        for candidate in candidates:  # one per genome (the latest evaluation)
            nominated[genome_key(self.space, candidate.genome)] = candidate
        batch = [
            ParetoMember(
                candidate_id=c.candidate_id,
                generation=c.generation,
                fitness=c.fitness,
                scores={d: float(c.metrics[d]) for d in ids},
                genome=c.genome,
                recipe=c.recipe,
            )
            for c in nominated.values()
        ]
        rescored = []
        for member in front_of(batch, ids, dev.sign)[:MAX_FRONT]:
            merged = merge_state_dicts(self.space.decode(member.genome), self.tensors, device=self.device)
            metrics = dev.score(merged)
            rescored.append(
                member.model_copy(update={"fitness": metrics["fitness"], "scores": {d: metrics[d] for d in ids}})
            )
        return front_of(rescored, ids, dev.sign)

    def promote(
        self, job_id: str, experiment_id: str, member: ParetoMember, model_id: str, chain: list[str]
    ) -> tuple[ModelRecord, dict[str, Any]]:
        """Merge one front member to disk, register it as ``model_id`` and score it once on test."""
        if self.models.exists(model_id):
            raise AlloyError(ErrorCode.ALREADY_EXISTS, f"model {model_id!r} already exists", {"model_id": model_id})
        recipe = self.space.decode(member.genome)
        lineage = {**self.lineage(job_id, experiment_id, member.candidate_id, chain, recipe), "promoted": True}
        # A folder of its own per request: two promotions of one member never write into the same folder.
        out_dir = self.storage_path / job_id / f".promote-{uuid.uuid4().hex[:12]}"
        try:
            record = self.publish(recipe, out_dir, model_id, lineage)
            if record is None:  # registered between the check above and now
                raise AlloyError(ErrorCode.ALREADY_EXISTS, f"model {model_id!r} already exists", {"model_id": model_id})
            test = self.test_scores(experiment_id, {model_id: _load_dir_tensors(out_dir)})
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)  # the registry copied it into the store
        scores = test["per_dataset"][model_id]
        return record, {"metric": test["metric"], "mean": scores[test["metric"]], "per_dataset": scores}

    def store_plot(self, job_id: str, candidates: list[Candidate]) -> dict[str, Any]:
        path = plot_fitness(
            candidates,
            self.storage_path / job_id / "fitness.png",
            title=f"{self.spec.name or job_id}: fitness by generation ({self.spec.search.kind})",
        )
        if self.store is None:
            return {"path": str(path)}
        info = self.store.put_file(f"evolutions/{job_id}/fitness.png", path)
        return {"key": info.key, "uri": info.uri, "size": info.size, "sha256": info.sha256}


def find_member(result: dict[str, Any] | None, job_id: str, candidate_id: str) -> ParetoMember:
    """The front member ``candidate_id`` of a completed evolution's result."""
    front = (result or {}).get("pareto_front")
    if front is None:
        raise AlloyError(
            ErrorCode.CONFLICT,
            f"evolution {job_id!r} has no Pareto front (only search.kind nsga2 has one)",
            {"job_id": job_id},
        )
    for raw in front:
        if raw["candidate_id"] == candidate_id:
            return ParetoMember.model_validate(raw)
    raise not_found("Pareto front member", candidate_id)


def _load_dir_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return as_tensors({"m": load_state_dict_arrays(model_dir)})["m"]
