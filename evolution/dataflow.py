"""The data-flow genome (DFS, after Sakana's "Evolutionary Optimization of Model Merging Recipes"): which layer of
which source model a token's hidden state flows through, step by step, decoded to an ordinary franken
(mergekit passthrough) ``slices`` recipe.

The path has ``T = repeats x num_layers`` steps; step ``t`` offers layer ``t mod num_layers`` (so with
``repeats > 1`` the path may run a layer again, as Sakana's does). Each step has two genes:

* ``step.<t>.source``: a choice gene over ``["skip", *sources]``: skip the step, or run that source's layer;
* ``step.<t>.scale``: the step's scale, applied through passthrough's ``scale`` to the tensors named by
  ``scale_filters`` (default: ``o_proj`` and ``down_proj``, the projections that write into the residual stream),
  every other tensor at 1. Scaling the residual writes scales the layer's *contribution* to the hidden state,
  the closest weight-space analogue of Sakana's per-transition scaling of a layer's input (a pre-norm layer's
  branches are blind to a scale of their input). A whole-layer scale would also scale the norms and q/k, i.e.
  change attention's temperature, and (through the first and last slices' parameters) the embeddings.

Sources are the parents, then the base model (``include_base``). PS+DFS is the two-stage form Sakana ran: a
parameter-space (PS) evolution first, its registered winner then one more source of a DFS evolution (see
``bench/evolve_bench.py --search ps+dfs``): the winner of both stages is an ordinary registered model and every
candidate is still merged in memory from parents in the object store.

Consecutive steps that run consecutive layers of one source at one scale decode to one slice, so the initial path
(every layer of ``init_source``, scale 1, repeats skipped) is the one slice ``[0, num_layers)`` of that model.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evolution.genes import Bounds, GeneSpec

SKIP = "skip"
SOURCE_GENE = "step_source"
SCALE_GENE = "step_scale"


class DataFlowGenome(BaseModel):
    """The typed settings of a data-flow genome (``genome.dataflow`` of an evolution request)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(..., ge=1, le=512, description="layers of every source (they share an architecture)")
    repeats: int = Field(1, ge=1, le=8, description="r: the path has r x num_layers steps")
    scale: Bounds = Field(
        default_factory=lambda: Bounds(low=0.5, high=1.5, init=1.0), description="bounds of every step's scale"
    )
    scale_filters: list[str] = Field(
        default_factory=lambda: ["o_proj", "down_proj"],
        min_length=1,
        max_length=8,
        description="tensor-name substrings the step's scale applies to (others stay at 1)",
    )
    include_base: bool = Field(True, description="the base model's layers are a source too")
    init_source: str | None = Field(
        None, description="the source of the initial path (default: the last source: the base model when it is one)"
    )

    @model_validator(mode="after")
    def _scale_admits_one(self) -> DataFlowGenome:
        if self.scale.low < 0:
            raise ValueError("a step's scale must not be negative")
        return self

    @property
    def steps(self) -> int:
        return self.repeats * self.num_layers


class Step(BaseModel):
    """One decoded step of the path: ``source``'s layer ``layer`` (None: skipped) at ``scale``."""

    source: str | None
    layer: int
    scale: float


def dataflow_sources(flow: DataFlowGenome, models: list[str], base_model: str | None) -> list[str]:
    sources = list(models)
    if flow.include_base and base_model is not None and base_model not in sources:
        sources.append(base_model)
    return sources


def dataflow_genes(flow: DataFlowGenome, sources: list[str]) -> list[GeneSpec]:
    """Two genes per step, in step order. The initial path runs ``init_source``'s layers once and skips the
    repeats."""
    choices = [SKIP, *sources]
    first = _init_index(flow, sources)
    genes = []
    for t in range(flow.steps):
        chosen = first if t < flow.num_layers else 0
        genes.append(
            GeneSpec(
                name=f"step.{t}.source",
                parameter=SOURCE_GENE,
                # Half-open: floor() lands on every choice with equal width; init at the middle of its interval.
                bounds=Bounds(low=0, high=len(choices) - 1e-6, init=chosen + 0.5),
                choices=choices,
            )
        )
        genes.append(GeneSpec(name=f"step.{t}.scale", parameter=SCALE_GENE, bounds=flow.scale))
    return genes


def decode_path(flow: DataFlowGenome, sources: list[str], genome: dict[str, float]) -> list[Step]:
    """Every step of the path (skipped ones included, as ``source=None``), scales rounded like every gene."""
    path = []
    for t in range(flow.steps):
        index = min(int(genome[f"step.{t}.source"]), len(sources))
        scale = round(flow.scale.clip(genome[f"step.{t}.scale"]), 6)
        path.append(Step(source=None if index == 0 else sources[index - 1], layer=t % flow.num_layers, scale=scale))
    return path


def path_slices(flow: DataFlowGenome, sources: list[str], path: list[Step]) -> list[dict[str, Any]]:
    """The passthrough slices of a path: runs of consecutive layers of one source at one scale become one slice.
    A path that skips every step is no model: it falls back to the first source's first layer (as the slot genome
    does), so every genome decodes to a valid recipe."""
    runs: list[list[Step]] = []
    for step in path:
        if step.source is None:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and (last.source, last.layer + 1, last.scale) == (step.source, step.layer, step.scale):
            runs[-1].append(step)
        else:
            runs.append([step])
    if not runs:
        return [_slice(flow, sources[0], 0, 1, 1.0)]
    return [_slice(flow, run[0].source or "", run[0].layer, run[-1].layer + 1, run[0].scale) for run in runs]


def decode_dataflow(
    flow: DataFlowGenome, sources: list[str], genome: dict[str, float], *, dtype: str | None, seed: int | None
) -> dict[str, Any]:
    """The franken recipe (plain dict, as :meth:`evolution.genome.GenomeSpace.decode_dict`) of one path."""
    slices = path_slices(flow, sources, decode_path(flow, sources, genome))
    recipe: dict[str, Any] = {"strategy": "franken_merge", "slices": slices}
    if dtype is not None:
        recipe["dtype"] = dtype
    if seed is not None:
        recipe["seed"] = seed
    return recipe


def _slice(flow: DataFlowGenome, model: str, start: int, end: int, scale: float) -> dict[str, Any]:
    # The catch-all 1.0 keeps every other tensor, and the embeddings / final norm that the first and last slices'
    # parameters also reach, unscaled.
    value = [*({"filter": name, "value": scale} for name in flow.scale_filters), {"value": 1.0}]
    return {"sources": [{"model": model, "layer_range": [start, end]}], "parameters": {"scale": value}}


def _init_index(flow: DataFlowGenome, sources: list[str]) -> int:
    """The choice index (1-based: 0 is skip) of the initial path's source."""
    if flow.init_source is None:
        return len(sources)  # the last source: the base when it is one
    if flow.init_source not in sources:
        raise ValueError(f"init_source {flow.init_source!r} is not one of the sources {sources}")
    return sources.index(flow.init_source) + 1


def encode_path(flow: DataFlowGenome, sources: list[str], path: list[Step]) -> dict[str, float]:
    """The genome of a path (one :class:`Step` per step, in order; a step's ``layer`` must be ``t mod
    num_layers``): each choice gene at the middle of its interval, so ``decode_path(encode_path(p)) == p``."""
    if len(path) != flow.steps:
        raise ValueError(f"a path has {flow.steps} steps, got {len(path)}")
    genome: dict[str, float] = {}
    for t, step in enumerate(path):
        if step.layer != t % flow.num_layers:
            raise ValueError(f"step {t} offers layer {t % flow.num_layers}, not {step.layer}")
        genome[f"step.{t}.source"] = (0 if step.source is None else sources.index(step.source) + 1) + 0.5
        genome[f"step.{t}.scale"] = flow.scale.clip(step.scale)
    return genome
