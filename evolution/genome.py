"""The genome of a merge recipe: a flat vector of bounded real genes that decodes to an ordinary Alloy recipe.

Why flat and named: Ray Tune moves configs between the driver, the schedulers and the searchers as plain dicts,
and its searchers unflatten keys on ``/``. Genes are therefore named ``<parameter>.<model index>[.g<group>]`` (per
model) or ``<parameter>[.g<group>]`` (global) and never contain a ``/``, even when model ids do (``org/model``).

Layer groups: with ``layer_groups = G > 1`` a parameter has one gene per group and decodes to a gradient list of
``G`` anchors (Alloy's per-layer gradient semantics interpolate between anchors over the depth of the model).

The optional layer-order (data-flow) genome of a franken merge is a fixed number of slots; each slot has three
genes (model, start layer, length) and decodes to one ``{model, layer_range: [start, end)}`` slice; a slot whose
length decodes to zero is skipped, so the search can also shorten the stack.

The optional data-flow genome (DFS, :mod:`evolution.dataflow`) is a layer path of ``repeats x num_layers`` steps,
each choosing a source model's layer (or a skip) and a scale; it decodes to a franken ``slices`` recipe and stands
alone (PS+DFS runs the parameter-space search first and adds its winner to the path's sources).

The optional operator gene (``operators``: merge method names, e.g. task_arithmetic, ties, tsv, iso_c, iso_cts)
chooses the merge method: a real gene over ``[0, n)`` floored to an index (so CMA-ES and Optuna's samplers search
it like any other gene), decoded to the method's strategy family and ``variant``; a searched parameter the chosen
method does not declare is left out of that recipe (TIES's density under task arithmetic). PBT's step treats it as
categorical: it switches to another method with probability ``sigma`` (and is redrawn with the resample
probability), never by a Gaussian step over an order the methods do not have.

``operator_parameters`` give a global parameter its own gene per method (``lambda.tsv``, ``lambda.iso_c``, ...),
each with the method's own bounds and start: the methods want very different values of one knob (task arithmetic
lambda ~0.8, TSV-M ~2, Iso-C ~4 on encoder-5task), and with one shared gene a PBT trial that switches method keeps
the last method's value, scores badly there and loses the next exploit round. With a gene per method a switch
lands on the new method's own value: near that method's start (an unpicked gene moves by PBT's small steps only),
not at the last method's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from evolution.dataflow import DataFlowGenome, dataflow_genes, dataflow_sources, decode_dataflow
from evolution.genes import Bounds, GeneSpec

Genome = dict[str, float]


OPERATOR_GENE = "operator"


class FrankenGenome(BaseModel):
    """Layer-order (data-flow) genome: ``slots`` slices drawn from the parents' layers."""

    model_config = ConfigDict(extra="forbid")

    slots: int = Field(4, ge=1, le=64)
    num_layers: int = Field(..., ge=1, description="layers of each parent (they share an architecture)")
    max_slice: int = Field(8, ge=1, description="longest slice one slot may contribute")


class GenomeSpace(BaseModel):
    """The typed search space over one strategy's parameters.

    ``per_model`` parameters get one gene per parent (and layer group); ``global_parameters`` one gene per layer
    group; ``fixed`` values are copied into every decoded recipe unchanged.
    """

    model_config = ConfigDict(extra="forbid")

    strategy: str
    models: list[str] = Field(..., min_length=1)
    base_model: str | None = None
    per_model: dict[str, Bounds] = Field(default_factory=dict)
    global_parameters: dict[str, Bounds] = Field(default_factory=dict)
    fixed: dict[str, Any] = Field(default_factory=dict)
    layer_groups: int = Field(1, ge=1, le=64)
    franken: FrankenGenome | None = None
    dataflow: DataFlowGenome | None = None  # the layer path (DFS): see evolution.dataflow
    operators: list[str] | None = Field(None, min_length=2, description="merge methods the operator gene picks")
    operator_parameters: dict[str, dict[str, Bounds]] = Field(
        default_factory=dict, description="global parameters with one gene per method: {parameter: {method: bounds}}"
    )
    dtype: str | None = None
    seed: int | None = None

    @field_validator("per_model", "global_parameters", "operator_parameters")
    @classmethod
    def _clean_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if "/" in name or "." in name:
                raise ValueError(f"parameter name {name!r} may not contain '/' or '.'")
        return value

    @model_validator(mode="after")
    def _something_to_search(self) -> GenomeSpace:
        if not (self.per_model or self.global_parameters or self.operator_parameters or self.franken or self.dataflow):
            raise ValueError(
                "the genome is empty: give per_model, global_parameters or operator_parameters bounds, a franken or "
                "a dataflow genome"
            )
        if self.dataflow is not None:
            _check_dataflow(self, self.dataflow)
            return self
        _check_against_strategy(self)
        return self

    # ---- the genes ---------------------------------------------------------------------------------------------
    def genes(self) -> list[GeneSpec]:
        """Every gene in a stable order (the order CMA-ES sees as its vector)."""
        genes: list[GeneSpec] = []
        for parameter, bounds in self.per_model.items():
            for index in range(len(self.models)):
                for group in self._groups():
                    genes.append(
                        GeneSpec(
                            name=_gene_name(parameter, index, group),
                            bounds=bounds,
                            parameter=parameter,
                            model_index=index,
                            group=group,
                        )
                    )
        for parameter, bounds in self.global_parameters.items():
            for group in self._groups():
                genes.append(
                    GeneSpec(name=_gene_name(parameter, None, group), bounds=bounds, parameter=parameter, group=group)
                )
        if self.franken is not None:
            genes.extend(self._franken_genes(self.franken))
        if self.dataflow is not None:
            genes.extend(dataflow_genes(self.dataflow, self.dataflow_sources()))
        if self.operators is not None:
            count = len(self.operators)
            genes.append(
                GeneSpec(
                    name=OPERATOR_GENE,
                    parameter=OPERATOR_GENE,
                    bounds=Bounds(low=0, high=count - 1e-6, init=0.5),  # the first listed method
                    choices=list(self.operators),
                )
            )
        for parameter, by_method in self.operator_parameters.items():
            for method, bounds in by_method.items():
                for group in self._groups():
                    name = _gene_name(_own_gene(parameter, method), None, group)
                    genes.append(GeneSpec(name=name, bounds=bounds, parameter=parameter, group=group))
        return genes

    def dataflow_sources(self) -> list[str]:
        """The models a data-flow path draws layers from (the parents, then the base): none without a path."""
        if self.dataflow is None:
            return []
        return dataflow_sources(self.dataflow, self.models, self.base_model)

    def gene_map(self) -> dict[str, GeneSpec]:
        return {gene.name: gene for gene in self.genes()}

    def _groups(self) -> list[int | None]:
        return [None] if self.layer_groups == 1 else list(range(self.layer_groups))

    def _franken_genes(self, franken: FrankenGenome) -> list[GeneSpec]:
        genes = []
        for slot in range(franken.slots):
            # The half-open upper bounds make floor() land on every index with equal width.
            genes.append(
                GeneSpec(
                    name=f"slot.{slot}.model",
                    parameter="slot_model",
                    bounds=Bounds(low=0, high=len(self.models) - 1e-6, init=slot % len(self.models)),
                )
            )
            genes.append(
                GeneSpec(
                    name=f"slot.{slot}.start",
                    parameter="slot_start",
                    bounds=Bounds(
                        low=0,
                        high=franken.num_layers - 1e-6,
                        init=min(slot * franken.max_slice, franken.num_layers - 1),
                    ),
                )
            )
            genes.append(
                GeneSpec(
                    name=f"slot.{slot}.length",
                    parameter="slot_length",
                    bounds=Bounds(low=0, high=franken.max_slice + 1 - 1e-6, init=franken.max_slice),
                )
            )
        return genes

    # ---- population operators ----------------------------------------------------------------------------------
    def initial(self) -> Genome:
        """The seed individual: every gene at its ``init`` (or the middle of its bounds)."""
        return {gene.name: gene.bounds.start for gene in self.genes()}

    def sample(self, rng: random.Random) -> Genome:
        """A uniform random individual."""
        return {gene.name: rng.uniform(gene.bounds.low, gene.bounds.high) for gene in self.genes()}

    def population(
        self, size: int, seed: int = 0, include_initial: bool = True, spread: float | None = None
    ) -> list[Genome]:
        """``size`` starting individuals, reproducibly: the seed individual (when asked) plus uniform samples, or
        with ``spread`` Gaussian neighbours of the seed individual (``spread`` x each gene's range): a local
        search around a known-good recipe instead of a blind one."""
        rng = random.Random(seed)
        members = [self.initial()] if include_initial else []
        while len(members) < size:
            if spread is None:
                members.append(self.sample(rng))
            else:
                members.append(self.perturb(self.initial(), rng, sigma=spread, resample_probability=0.0))
        return members[:size]

    def perturb(
        self, genome: Genome, rng: random.Random, sigma: float = 0.1, resample_probability: float = 0.1
    ) -> Genome:
        """Explore: Gaussian noise of ``sigma`` × range on every gene, clipped to its bounds; each gene is
        instead resampled uniformly with ``resample_probability`` (keeps diversity after many exploits)."""
        child: Genome = {}
        for gene in self.genes():
            bounds = gene.bounds
            value = genome.get(gene.name, bounds.start)
            if gene.choices is not None:
                child[gene.name] = _step_choice(value, len(gene.choices), rng, sigma, resample_probability)
            elif rng.random() < resample_probability:
                child[gene.name] = rng.uniform(bounds.low, bounds.high)
            else:
                child[gene.name] = bounds.clip(value + rng.gauss(0.0, sigma * (bounds.high - bounds.low)))
        return child

    def validate_genome(self, genome: Genome) -> Genome:
        """Exactly this space's genes, each finite and inside its bounds (values are clipped, not refused:
        searchers may step a hair outside)."""
        genes = self.gene_map()
        missing = sorted(set(genes) - set(genome))
        unknown = sorted(set(genome) - set(genes))
        if missing or unknown:
            raise ValueError(f"genome does not match the space: missing {missing}, unknown {unknown}")
        clean: Genome = {}
        for name, spec in genes.items():
            value = float(genome[name])
            if not math.isfinite(value):
                raise ValueError(f"gene {name} is not finite")
            clean[name] = spec.bounds.clip(value)
        return clean

    # ---- decoding ----------------------------------------------------------------------------------------------
    def decode_dict(self, genome: Genome) -> dict[str, Any]:
        """The recipe as the plain dict Alloy's ``MergeRecipe`` validates (kept dict-shaped so that decoding
        needs no merge code, e.g. in the driver's tracker callback)."""
        genome = self.validate_genome(genome)
        if self.dataflow is not None:  # a path genome has no other genes (PS+DFS runs PS as its first stage)
            return decode_dataflow(self.dataflow, self.dataflow_sources(), genome, dtype=self.dtype, seed=self.seed)
        method = self.operator_of(genome)
        declared = _declared_by(method)
        models = []
        for index, model_id in enumerate(self.models):
            parameters = {name: self._value(genome, name, index) for name in self.per_model if declared(name)}
            models.append({"model": model_id, "parameters": parameters})
        searched = {name: self._value(genome, name, None) for name in self.global_parameters if declared(name)}
        for name, by_method in self.operator_parameters.items():
            if method in by_method:  # the method's own gene (a method that does not declare it has none)
                searched[name] = self._value(genome, _own_gene(name, method), None)
        recipe: dict[str, Any] = {
            "strategy": self.strategy if method is None else _family_of(method),
            "models": models,
            "parameters": {**{k: v for k, v in self.fixed.items() if declared(k)}, **searched},
        }
        if method is not None:
            recipe["variant"] = method
        if self.base_model is not None:
            recipe["base_model"] = self.base_model
        if self.franken is not None:
            recipe["slices"] = self._decode_slices(genome, self.franken)
        if self.dtype is not None:
            recipe["dtype"] = self.dtype
        if self.seed is not None:
            recipe["seed"] = self.seed
        return recipe

    def operator_of(self, genome: Genome) -> str | None:
        """The merge method the operator gene picks (None: the space has no operator gene)."""
        if self.operators is None:
            return None
        return self.operators[min(int(genome[OPERATOR_GENE]), len(self.operators) - 1)]

    def decode(self, genome: Genome):
        """``genome -> alloy.merge.recipe.MergeRecipe``."""
        from alloy.merge.recipe import MergeRecipe  # lazily: the genome itself needs no merge engine

        return MergeRecipe.model_validate(self.decode_dict(genome))

    def _value(self, genome: Genome, parameter: str, index: int | None) -> float | list[float]:
        if self.layer_groups == 1:
            return round(genome[_gene_name(parameter, index, None)], 6)
        return [round(genome[_gene_name(parameter, index, group)], 6) for group in range(self.layer_groups)]

    def _decode_slices(self, genome: Genome, franken: FrankenGenome) -> list[dict[str, Any]]:
        slices = []
        for slot in range(franken.slots):
            model = self.models[min(int(genome[f"slot.{slot}.model"]), len(self.models) - 1)]
            start = min(int(genome[f"slot.{slot}.start"]), franken.num_layers - 1)
            length = min(int(genome[f"slot.{slot}.length"]), franken.max_slice, franken.num_layers - start)
            if length > 0:
                slices.append({"model": model, "layer_range": [start, start + length]})
        if not slices:  # an empty stack is no model: fall back to the first parent's first layer
            slices.append({"model": self.models[0], "layer_range": [0, 1]})
        return slices


def _check_against_strategy(space: GenomeSpace) -> None:
    """Every searched parameter must be one the strategy declares, in its scope and inside its legal range, so a
    decoded genome is always a valid recipe (the search never wastes candidates on refused recipes). Checked by
    validating the recipes at both corners of the search box (for every method the operator gene can pick): the
    recipe validator is the one source of truth."""
    if space.franken is not None and space.strategy != "franken_merge":
        raise ValueError("a layer-order genome needs strategy franken_merge")
    methods: list[str | None] = list(space.operators) if space.operators is not None else [None]
    if space.operators is not None:
        for name in [*space.per_model, *space.global_parameters]:
            if not any(_declared_by(m)(name) for m in methods):
                raise ValueError(f"no operator of {space.operators} has a parameter {name!r}")
    _check_operator_parameters(space)
    for method in methods:
        for corner in ("low", "high"):
            _check_corner(space, method, corner)


def _check_operator_parameters(space: GenomeSpace) -> None:
    """Each parameter with a gene per method: an operator gene to pick the method, no shared gene beside it, and
    bounds for exactly the listed methods that declare the parameter (a method without them would have no value
    to decode; a method that does not declare it would have a gene that never reaches a recipe)."""
    if not space.operator_parameters:
        return
    if space.operators is None:
        raise ValueError("operator_parameters need an operator gene (operators)")
    for name, by_method in space.operator_parameters.items():
        if name in space.global_parameters or name in space.per_model:
            raise ValueError(f"{name!r} is both a shared and a per-method parameter: give it in one place")
        declaring = [m for m in space.operators if _declared_by(m)(name)]
        if sorted(by_method) != sorted(declaring):
            raise ValueError(
                f"operator_parameters.{name} needs bounds for exactly the listed methods that declare it: "
                f"{declaring}, got {sorted(by_method)}"
            )


def _check_dataflow(space: GenomeSpace, flow: DataFlowGenome) -> None:
    """A path genome stands alone (franken_merge, no parameter genes) and every path it can decode to is a valid
    recipe: checked on the initial path and on the one that runs every step of the last source at each scale
    bound (the longest stack, every step its own scale)."""
    from alloy.errors import AlloyError
    from alloy.merge.recipe import MergeRecipe, validate_recipe

    if space.strategy != "franken_merge":
        raise ValueError("a dataflow genome needs strategy franken_merge")
    if space.per_model or space.global_parameters or space.operator_parameters or space.franken or space.operators:
        raise ValueError("a dataflow genome takes no other genes (PS+DFS runs the PS search as its first stage)")
    genes = dataflow_genes(flow, space.dataflow_sources())
    # Every step runs (the last source), the scales alternate between their bounds: no two steps merge.
    longest = {g.name: g.bounds.high if g.choices or i % 4 == 3 else g.bounds.low for i, g in enumerate(genes)}
    for genome in ({g.name: g.bounds.start for g in genes}, longest):
        try:
            validate_recipe(MergeRecipe.model_validate(space.decode_dict(genome)))
        except AlloyError as exc:
            raise ValueError(f"the search space can decode to a refused recipe: {exc.message}") from None


def _check_corner(space: GenomeSpace, method: str | None, corner: str) -> None:
    from alloy.errors import AlloyError
    from alloy.merge.recipe import MergeRecipe, validate_recipe

    declared = _declared_by(method)
    per_model = {name: getattr(bounds, corner) for name, bounds in space.per_model.items() if declared(name)}
    searched = {name: getattr(b, corner) for name, b in space.global_parameters.items() if declared(name)}
    for name, by_method in space.operator_parameters.items():
        if method in by_method:
            searched[name] = getattr(by_method[method], corner)
    recipe: dict[str, Any] = {
        "strategy": space.strategy if method is None else _family_of(method),
        "models": [{"model": m, "parameters": per_model} for m in space.models],
        "parameters": {**{k: v for k, v in space.fixed.items() if declared(k)}, **searched},
    }
    if method is not None:
        recipe["variant"] = method
    if space.base_model is not None:
        recipe["base_model"] = space.base_model
    if space.franken is not None:
        recipe["slices"] = [{"model": m, "layer_range": [0, 1]} for m in space.models]
    try:
        validate_recipe(MergeRecipe.model_validate(recipe))
    except AlloyError as exc:
        raise ValueError(f"the search space can decode to a refused recipe: {exc.message}") from None


def _declared_by(method: str | None) -> Callable[[str], bool]:
    """Whether ``method`` declares a parameter (every parameter passes when no operator gene picks the method)."""
    if method is None:
        return lambda name: True
    from kernels.registry import get_method  # lazily: the genome itself needs no merge kernels

    index = get_method(method).param_index
    return lambda name: name in index


def _family_of(method: str) -> str:
    from kernels.registry import get_method

    return get_method(method).family


def _step_choice(value: float, count: int, rng: random.Random, sigma: float, resample_probability: float) -> float:
    """A choice gene's step: another choice with probability ``sigma``, a uniform redraw with the resample
    probability, else the same choice (at the middle of its interval, so clipping never moves it)."""
    index = min(int(value), count - 1)
    if rng.random() < resample_probability:
        index = rng.randrange(count)
    elif rng.random() < sigma:
        index = rng.choice([i for i in range(count) if i != index])
    return index + 0.5


def _own_gene(parameter: str, method: str) -> str:
    """The name of ``parameter``'s gene for ``method`` (before a layer group's suffix): ``lambda.tsv``."""
    return f"{parameter}.{method}"


def _gene_name(parameter: str, model_index: int | None, group: int | None) -> str:
    name = parameter if model_index is None else f"{parameter}.{model_index}"
    return name if group is None else f"{name}.g{group}"
