"""What an evolution runs on: its parents (model id -> local folder), base model and fitness datasets, resolved
from the registries or from a zoo preset, and the genome space over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from alloy.errors import AlloyError, ErrorCode
from alloy.evaluation.dataset_sources import LocalDatasets, RegistryDatasets
from alloy.evaluation.loading import model_kind
from alloy.merge.methods import check_family
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.zoo.presets import PRESETS, build_preset, register_preset
from evolution.config import EvolutionSpec
from evolution.genome import GenomeSpace


class ResolvedInputs(BaseModel):
    """Parents (model id -> local folder), the base, and the fitness datasets of one evolution."""

    model_config = {"arbitrary_types_allowed": True}

    parents: dict[str, Path]
    base_model: str | None
    dataset_ids: list[str]
    source: Any  # a DatasetSource


def resolve_inputs(
    spec: EvolutionSpec,
    *,
    data_dir: Path,
    models: ModelRegistry,
    datasets: DatasetRegistry | None,
    store: ArtifactStore | None,
) -> ResolvedInputs:
    if spec.preset is not None:
        return _preset_inputs(spec, data_dir=data_dir, models=models, datasets=datasets, store=store)
    parents = {model_id: models.local_dir(model_id) for model_id in spec.models or []}
    if spec.base_model is not None:
        parents = {spec.base_model: models.local_dir(spec.base_model), **parents}
    return ResolvedInputs(
        parents=parents,
        base_model=spec.base_model,
        dataset_ids=list(spec.datasets or []),
        source=RegistryDatasets(datasets, store),
    )


def _preset_inputs(
    spec: EvolutionSpec,
    *,
    data_dir: Path,
    models: ModelRegistry,
    datasets: DatasetRegistry | None,
    store: ArtifactStore | None,
) -> ResolvedInputs:
    assert spec.preset is not None
    manifest = build_preset(spec.preset, data_dir)  # reuses a finished build
    register_preset(manifest, models, datasets, store=store)
    base_id = spec.base_model or manifest.base.model_id
    model_ids = spec.models or [m.model_id for m in manifest.finetunes(base_id)]
    base = manifest.model(base_id)
    dataset_ids = spec.datasets or [
        d.dataset_id for d in manifest.datasets if _dataset_model_kind(d.task) == model_kind(Path(base.path))
    ]
    parents = {base_id: base.path, **{m: manifest.model(m).path for m in model_ids}}
    return ResolvedInputs(
        parents=parents, base_model=base_id, dataset_ids=dataset_ids, source=LocalDatasets(manifest.datasets)
    )


def genome_space(spec: EvolutionSpec, inputs: ResolvedInputs) -> GenomeSpace:
    merged = [m for m in inputs.parents if m != inputs.base_model]
    genome = spec.genome
    try:
        return GenomeSpace(
            strategy=spec.strategy,
            models=merged,
            base_model=inputs.base_model,
            per_model=genome.per_model,
            global_parameters=genome.global_parameters,
            fixed=genome.fixed,
            layer_groups=genome.layer_groups,
            franken=genome.franken,
            dataflow=genome.dataflow,
            operators=genome.operators,
            operator_parameters=genome.operator_parameters,
            dtype=spec.dtype,
            seed=spec.search.seed,
        )
    except ValueError as exc:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"invalid genome: {exc}", {"field": "genome"}) from None


# A preset's fine-tunes are known only once it is built: before a job exists its genome is checked over this many
# stand-in parents (every method takes two).
PRESET_STAND_INS = 2


def check_before_job(spec: EvolutionSpec) -> None:
    """What refuses an evolution request before a job exists, without a model file or a registry: the strategy
    (INVALID_STRATEGY, as for a merge), a known preset, and a genome whose every decoded recipe is valid (the same
    check the run makes, over the request's parents, or stand-ins for a preset's fine-tunes)."""
    check_family(spec.strategy)
    if spec.preset is not None and spec.preset not in PRESETS:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"unknown preset {spec.preset!r}; presets: {', '.join(sorted(PRESETS))}",
            {"field": "preset", "known": sorted(PRESETS)},
        )
    models = spec.models or [f"preset-parent-{i}" for i in range(PRESET_STAND_INS)]
    base = spec.base_model or ("preset-base" if spec.preset is not None else None)
    stand_ins = ResolvedInputs(
        parents={m: Path() for m in [*([base] if base else []), *models]},
        base_model=base,
        dataset_ids=list(spec.datasets or []),
        source=None,
    )
    genome_space(spec, stand_ins)


def skeleton_dir(inputs: ResolvedInputs) -> Path:
    """The folder whose config and tokenizer every candidate uses: the base model's, else the first parent's."""
    return inputs.parents[inputs.base_model] if inputs.base_model else next(iter(inputs.parents.values()))


def _dataset_model_kind(task: dict[str, Any]) -> str:
    # prototype-head classification scores encoders; perplexity and log-likelihood tasks score causal LMs
    if task.get("type") == "classification" and task.get("head", "prototypes") == "prototypes":
        return "encoder"
    return "causal_lm"
