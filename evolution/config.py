"""What an evolution is asked to do: the typed request shared by ``POST /evolutions``, the batch runner's YAML
(``configs/evolve-<preset>.yaml``) and the benchmark.

An evolution names its parents and its fitness data either through a benchmark preset (``preset: tiny`` gives
the fine-tunes, their base and the dev/test datasets) or explicitly (``models``, ``base_model``, ``datasets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from alloy.errors import AlloyError, ErrorCode, from_validation_error
from alloy.ids import ResourceId, ShortText
from alloy.jobs.merge_request import SplitName
from evolution.dataflow import DataFlowGenome
from evolution.genome import Bounds, FrankenGenome

# pbt: population-based training; cmaes: CMA-ES; tpe: multivariate TPE (a Parzen-estimator model of the good and the
# bad genomes, gene by gene jointly, so the operator gene and its lambda are learnt together); random: uniform random
# search over the same genome and budget (the baseline); nsga2: NSGA-II over the per-dataset dev scores
# (multi-objective: the result has a Pareto front).
SearchKind = Literal["pbt", "cmaes", "tpe", "random", "nsga2"]
# fixed: every candidate is scored once, on its generation's dev batch (``dev_batch_size``; null: the whole dev
# split). asha: successive halving on nested seeded dev subsets (evolution.racing): a candidate is scored on the
# smallest subset and goes on to the next (``reduction_factor`` times larger) only while it is in the top
# 1/reduction_factor of what earlier generations scored there; the last rung is the whole dev split, and only
# candidates that reached it can be selected.
Fidelity = Literal["fixed", "asha"]
MAX_RUNG_SHRINK = 1024  # reduction_factor ** (rungs - 1): the smallest rung is at least 1/1024 of each dev set


class GenomeBounds(BaseModel):
    """The searched parameters of the strategy (the parents come from the request, not from here)."""

    model_config = ConfigDict(extra="forbid")

    per_model: dict[ShortText, Bounds] = Field(
        default_factory=dict, max_length=32, description="e.g. weight, density, drop_rate"
    )
    global_parameters: dict[ShortText, Bounds] = Field(
        default_factory=dict, max_length=32, description="e.g. lambda, t"
    )
    fixed: dict[ShortText, Any] = Field(
        default_factory=dict, max_length=32, description="copied into every recipe, e.g. normalize"
    )
    layer_groups: int = Field(1, ge=1, le=64, description="> 1: one gene per layer group (a gradient list)")
    franken: FrankenGenome | None = None
    dataflow: DataFlowGenome | None = Field(
        None, description="a layer-path (DFS) genome: strategy franken_merge, no other genes"
    )
    operators: list[str] | None = Field(
        None,
        min_length=2,
        max_length=16,
        description="an operator gene: the merge method (e.g. task_arithmetic, ties, tsv, iso_c, iso_cts) is "
        "searched too; a searched parameter a method does not declare is left out of its recipes",
    )
    operator_parameters: dict[ShortText, dict[ShortText, Bounds]] = Field(
        default_factory=dict,
        max_length=8,
        description="with operators: a global parameter with its own gene, bounds and start per method, e.g. "
        "{lambda: {task_arithmetic: [0.2, 2, 0.8], tsv: [0.5, 4, 2]}} (a switch of method lands on that "
        "method's own value); every listed method that declares the parameter needs bounds",
    )


class SearchSettings(BaseModel):
    """Budget and search algorithm."""

    model_config = ConfigDict(extra="forbid")

    kind: SearchKind = "pbt"
    population: int = Field(
        8, ge=2, le=256, description="PBT trials; CMA-ES / NSGA-II population; random: candidates per generation"
    )
    generations: int = Field(8, ge=1, le=1000, description="PBT training iterations; generations of the other kinds")
    time_budget_s: float | None = Field(
        None, gt=0, le=30 * 86400, description="stop the search after this many seconds"
    )
    target_fitness: float | None = Field(
        None, allow_inf_nan=False, description="stop as soon as a candidate reaches it"
    )
    quantile_fraction: float = Field(0.25, gt=0, le=0.5, description="PBT: bottom share replaced each generation")
    sigma: float = Field(0.1, gt=0, le=1, description="mutation step, as a fraction of each gene's range")
    resample_probability: float = Field(0.1, ge=0, le=1, description="PBT: chance a gene is redrawn uniformly")
    include_initial: bool = Field(True, description="seed the population with the genome's init values")
    init_spread: float | None = Field(
        None,
        gt=0,
        le=1,
        description="start the population around the init genome (Gaussian, this fraction of each gene's range) "
        "instead of uniformly over the bounds; CMA-ES: its initial step size",
    )
    dev_batch_size: int | None = Field(
        64, ge=1, le=1_000_000, description="examples per rotating dev batch; None: whole dev split"
    )
    finalists: int = Field(
        3, ge=1, le=32, description="best distinct genomes re-scored on the whole dev split (and the starting genome)"
    )
    fidelity: Fidelity = Field("fixed", description="fixed: one dev batch per candidate; asha: successive halving")
    rungs: int = Field(3, ge=2, le=8, description="asha: fidelity levels, the last one the whole dev split")
    reduction_factor: int = Field(
        3, ge=2, le=8, description="asha: each rung scores this many times the examples of the one before"
    )
    cpus_per_trial: float = Field(0.5, gt=0, le=64)
    gpus_per_trial: float = Field(0.0, ge=0, le=8)
    max_concurrent_trials: int | None = Field(None, ge=1, le=256)
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="one seed, one run: the initial population, PBT's donors and steps, CMA-ES "
        "and every trial's random generators are drawn from it",
    )

    @model_validator(mode="after")
    def _racing_sound(self) -> SearchSettings:
        if self.fidelity != "asha":
            return self
        if self.reduction_factor ** (self.rungs - 1) > MAX_RUNG_SHRINK:
            raise ValueError(f"reduction_factor ** (rungs - 1) must be at most {MAX_RUNG_SHRINK}")
        if self.kind == "nsga2":  # racing ranks the mean fitness; NSGA-II ranks every dataset's score
            raise ValueError("fidelity asha needs a single-objective kind (pbt, cmaes or random)")
        if "dev_batch_size" in self.model_fields_set and self.dev_batch_size is not None:
            # the rungs are the dev subsets: a rotating batch on top would make the last rung less than the split
            raise ValueError("fidelity asha scores its own dev subsets: leave dev_batch_size out or null")
        return self


class EvolutionSpec(BaseModel):
    """One evolution request."""

    model_config = ConfigDict(extra="forbid")

    name: ShortText | None = None
    preset: ResourceId | None = Field(None, description="benchmark preset giving parents, base and datasets")
    models: list[ResourceId] | None = Field(
        None, min_length=1, max_length=8, description="parents; default: the preset's fine-tunes"
    )
    base_model: ResourceId | None = None
    datasets: list[ResourceId] | None = Field(
        None, min_length=1, max_length=32, description="fitness datasets; default: the preset's"
    )
    dev_split: SplitName = "dev"
    test_split: SplitName = "test"
    strategy: ShortText = "task_arithmetic"  # one of the five, checked with INVALID_STRATEGY as a merge is
    genome: GenomeBounds
    search: SearchSettings = SearchSettings()
    output_model_id: ResourceId | None = None
    dtype: Literal["float32", "float16", "bfloat16"] | None = None

    @model_validator(mode="after")
    def _parents_known(self) -> EvolutionSpec:
        if self.preset is None and (not self.models or not self.datasets):
            raise ValueError("give a preset, or both models and datasets")
        return self


def parse_spec(data: dict[str, Any]) -> EvolutionSpec:
    """Validate a request; errors are VALIDATION_FAILED naming the first bad field."""
    try:
        return EvolutionSpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, "invalid evolution") from None


def load_spec_file(path: str | Path) -> EvolutionSpec:
    """A ``configs/evolve-<preset>.yaml`` file."""
    with Path(path).open() as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{path}: the top level must be a mapping")
    return parse_spec(data)
