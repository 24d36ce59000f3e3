"""From a validated recipe and the models' tensor layouts to the list of output tensors and how to make each.

The plan is an output-slice plan: the output layers are the recipe's slices one after another (a ``models:``
recipe is one slice over every layer), and output layer ``i`` of a slice is merged from layer ``start + i`` of each
of that slice's sources, with the slice's parameters and ``t = i / (length - 1)`` (mergekit's depth, counted within
the slice). Tensors outside the layer stack come from the first slice's sources (embeddings) or the last slice's
(final norm, LM head), at ``t = 0``. A franken merge is the case of one source per slice.

The plan is built from shapes and dtypes only, so the on-disk merge (layouts from safetensors headers) and the
in-memory merge (layouts from state dicts) share it and produce the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.methods import get_method, uses_base
from alloy.merge.recipe import MergeRecipe, OutputSlice, SliceSource
from alloy.merge.recipe_checks import models_base, slice_base
from kernels.franken import is_embedding, renumber
from kernels.params import layer_index
from kernels.vocabulary import VocabularyAlignment

OUTPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


Layout = Mapping[str, TensorMeta]  # tensor name -> shape and dtype, for one model


@dataclass(frozen=True)
class TensorTask:
    output_name: str
    sources: tuple[tuple[str, str], ...]  # (model id, source tensor name), in the slice's source order
    shape: tuple[int, ...]
    dtype: torch.dtype  # output dtype
    depth: float  # t in [0, 1] for gradient parameters, within the slice
    compute: bool  # False: the base (or only) source is copied (integer buffers)
    input_bytes: int  # float32 bytes of the inputs and result: what the scheduler budgets
    slice_index: int = 0  # the output slice whose parameters apply
    base_index: int | None = None  # position of the slice's base among ``sources``
    vocabulary: VocabularyAlignment | None = None  # embedding rows aligned to the output vocabulary first


@dataclass(frozen=True)
class MergePlan:
    recipe: MergeRecipe  # validated, canonical parameter names
    method: Any  # the kernels' method spec
    model_ids: tuple[str, ...]
    base_id: str  # the model whose config and tokenizer files the output takes
    slices: tuple[OutputSlice, ...]  # concrete output slices (a models: recipe is one slice)
    tasks: tuple[TensorTask, ...]
    output_layers: int | None  # None: the layers are the base's (a models: recipe), config left as it is
    layer_origins: tuple[int, ...]  # per output layer, the layer of the base model's config it describes

    @property
    def spec(self) -> Any:
        return self.method


def count_layers(names: list[str] | Any) -> int:
    indices = [i for i in (layer_index(n) for n in names) if i is not None]
    return max(indices) + 1 if indices else 0


def layer_stack(name: str) -> str | None:
    """The layer stack a tensor belongs to: the name before its layer index (``model.layers``,
    ``vision_tower.transformer.layers``), None outside any stack. A multimodal model has several."""
    index = layer_index(name)
    if index is None:
        return None
    marker = f".{index}."
    return name[: name.index(marker)] if not name.startswith(f"{index}.") and marker in name else ""


def stack_sizes(names: list[str] | Any) -> dict[str, int]:
    """Layers per stack, in order of first appearance."""
    sizes: dict[str, int] = {}
    for name in names:
        stack, index = layer_stack(name), layer_index(name)
        if stack is not None and index is not None:
            sizes[stack] = max(sizes.get(stack, 0), index + 1)
    return sizes


def natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in name.replace("-", ".").split(".")]


def concrete_slices(
    recipe: MergeRecipe, layer_counts: Mapping[str, int], stacks_by_model: Mapping[str, Mapping[str, int]] | None = None
) -> tuple[OutputSlice, ...]:
    """The recipe's output slices with their ranges checked against the models (VALIDATION_FAILED naming the
    slice), or the one slice over every layer of a ``models:`` recipe (mergekit: base added, without parameters)."""
    if not recipe.slices:
        base = models_base(recipe)
        layers = layer_counts[base] if base else layer_counts[recipe.model_ids[0]]
        # mergekit's input order: the models, then the base when it is not among them (an order-sensitive method
        # such as karcher sums its inputs in this order)
        listed = [ref.model for ref in recipe.models]
        inputs = listed + [base] if base is not None and base not in listed else recipe.model_ids
        sources = [SliceSource(model=m, layer_range=(0, layers)) for m in inputs] if layers else []
        if not sources:
            return ()
        return (OutputSlice(sources=sources, base_model=base),)
    for model, stacks in (stacks_by_model or {}).items():
        if len(stacks) > 1:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"{model!r} has several layer stacks ({', '.join(stacks)}): slicing it needs mergekit's modules: "
                "syntax, which Alloy does not support; merge it with models: instead",
                {"field": "slices"},
            )
    for k, piece in enumerate(recipe.slices):
        for j, source in enumerate(piece.sources):
            available = layer_counts[source.model]
            start, end = source.layer_range
            if end > available:
                raise AlloyError(
                    ErrorCode.VALIDATION_FAILED,
                    f"slice {k}: layer_range [{start}, {end}) is outside {source.model!r}'s {available} layers "
                    "(end is exclusive)",
                    {"parameter": "slices", "field": f"slices.{k}.sources.{j}.layer_range"},
                )
    return tuple(piece.model_copy(update={"base_model": slice_base(recipe, piece)}) for piece in recipe.slices)


def build_plan(recipe: MergeRecipe, layouts: Mapping[str, Layout], rows: Any = None) -> MergePlan:
    """``recipe`` must already have passed :func:`alloy.merge.recipe.validate_recipe` and the layouts
    :func:`alloy.merge.compatibility.check_layouts`. ``rows``: the
    :class:`alloy.merge.tokenizer_rows.RowPlanner` of a merge that builds an output vocabulary."""
    method = get_method(recipe.variant or recipe.strategy)
    output_dtype = OUTPUT_DTYPES[recipe.dtype] if recipe.dtype else None
    compute_dtype = OUTPUT_DTYPES[recipe.compute_dtype] if recipe.compute_dtype else None
    counts = {m: count_layers(layout) for m, layout in layouts.items()}
    stacks = {m: stack_sizes(layout) for m, layout in layouts.items()}
    slices = concrete_slices(recipe, counts, stacks)
    builder = _TaskBuilder(layouts, output_dtype or compute_dtype, uses_base(method), rows)
    # mergekit writes such a method's float32 result as it is, unless out_dtype casts it
    builder.float32_result = output_dtype is None and recipe.is_mergekit and method.float32_result
    builder.compute_dtype = compute_dtype
    base_id = recipe.base if recipe.base in layouts else recipe.model_ids[0]
    origins: list[int] = []
    if slices and not recipe.slices:
        # every layer of every stack (mergekit: one module each), gradients over each stack's own depth
        only = slices[0]
        builder.outside_layers(only, 0, lambda name: True)
        for stack, size in stacks[_reference(only).model].items():
            piece = only.model_copy(
                update={"sources": [s.model_copy(update={"layer_range": (0, size)}) for s in only.sources]}
            )
            builder.layers(piece, 0, 0, stack=stack)
    elif slices:
        first, last = slices[0], slices[-1]
        builder.outside_layers(first, 0, lambda name: is_embedding(name))
        for k, piece in enumerate(slices):
            origins += builder.layers(piece, k, len(origins))
        builder.outside_layers(last, len(slices) - 1, lambda name: not is_embedding(name))
    else:  # no layer stack at all: every tensor merged as a whole
        only = OutputSlice(
            sources=[SliceSource(model=m, layer_range=(0, 1)) for m in recipe.model_ids], base_model=models_base(recipe)
        )
        builder.outside_layers(only, 0, lambda name: True)
        slices = (only,)
    return MergePlan(
        recipe,
        method,
        tuple(recipe.model_ids),
        base_id,
        slices,
        tuple(builder.tasks),
        len(origins) if recipe.slices else None,
        tuple(origins),
    )


def _reference(piece: OutputSlice) -> SliceSource:
    """The source whose tensor names define the slice's output: its base when the base is an input."""
    for source in piece.sources:
        if source.model == piece.base_model:
            return source
    return piece.sources[0]


class _TaskBuilder:
    def __init__(self, layouts: Mapping[str, Layout], output_dtype: torch.dtype | None, with_base: bool, rows=None):
        self.layouts = layouts
        self.rows = rows
        self.with_base = with_base  # False: the method ignores the base (linear, karcher, passthrough)
        self.output_dtype = output_dtype
        self.float32_result = False  # output the float32 result of the method (MethodSpec.float32_result)
        self.compute_dtype: torch.dtype | None = None  # None: the inputs' promoted dtype
        self.tasks: list[TensorTask] = []
        self._by_layer: dict[str, dict[int, list[str]]] = {}

    def names_at(self, model: str, index: int, stack: str | None = None) -> list[str]:
        if model not in self._by_layer:
            by_layer: dict[int, list[str]] = {}
            for name in sorted(self.layouts[model], key=natural_key):
                layer = layer_index(name)
                if layer is not None:
                    by_layer.setdefault(layer, []).append(name)
            self._by_layer[model] = by_layer
        names = self._by_layer[model].get(index, [])
        return names if stack is None else [n for n in names if layer_stack(n) == stack]

    def outside_layers(self, piece: OutputSlice, slice_index: int, keep) -> None:
        reference = _reference(piece)
        for name in sorted(self.layouts[reference.model], key=natural_key):
            if layer_index(name) is None and keep(name):
                self.add(name, [(s.model, name) for s in piece.sources], piece, slice_index, 0.0)

    def layers(self, piece: OutputSlice, slice_index: int, first_output: int, stack: str | None = None) -> list[int]:
        reference = _reference(piece)
        origins = []
        for offset in range(piece.length):
            depth = offset / (piece.length - 1) if piece.length > 1 else 1.0
            out_index = first_output + offset
            ref_layer = reference.layer_range[0] + offset
            for name in self.names_at(reference.model, ref_layer, stack):
                sources = [(s.model, renumber(name, s.layer_range[0] + offset)) for s in piece.sources]
                self.add(renumber(name, out_index), sources, piece, slice_index, depth)
            origins.append(ref_layer)
        return origins

    def add(
        self, output_name: str, sources: list[tuple[str, str]], piece: OutputSlice, slice_index: int, depth: float
    ) -> None:
        models = [m for m, _ in sources]
        position = models.index(piece.base_model) if piece.base_model in models else None
        base_index = position if self.with_base else None
        reference = position or 0
        ref_model, ref_name = sources[reference]
        ref_meta = self.layouts[ref_model].get(ref_name)
        metas = []
        vocabulary = self.rows is not None and self.rows.covers(output_name)
        free = 1 if vocabulary else 0  # rows of a vocabulary tensor are aligned, not compared
        for model, name in sources:
            meta = self.layouts[model].get(name)
            if meta is None or ref_meta is None or meta.shape[free:] != ref_meta.shape[free:]:
                shapes = [list(ref_meta.shape) if ref_meta else None, list(meta.shape) if meta else None]
                raise AlloyError(
                    ErrorCode.INCOMPATIBLE_MODELS,
                    f"tensor {name!r} is {_describe(shapes[1])} in {model!r} but "
                    f"{_describe(shapes[0])} in {ref_model!r}",
                    {"tensor": name, "shapes": shapes, "models": [ref_model, model]},
                )
            metas.append(meta)
        meta = metas[reference]
        floating = meta.dtype.is_floating_point
        alignment = None
        if vocabulary and floating:
            alignment = self.rows.alignment(models, piece.base_model, {m: x.shape[0] for m, x in zip(models, metas)})
            meta = TensorMeta((self.rows.rows, *meta.shape[1:]), meta.dtype)
        self.tasks.append(
            TensorTask(
                output_name=output_name,
                sources=tuple(sources) if floating else (sources[reference],),
                shape=meta.shape,
                dtype=self._output_dtype(metas, reference) if floating else meta.dtype,
                depth=depth,
                compute=floating,
                # inputs plus the float32 result: what a kernel holds at least
                input_bytes=meta.numel * 4 * (len(sources) + 1 if floating else 1),
                slice_index=slice_index,
                base_index=base_index if floating else None,
                vocabulary=alignment,
            )
        )

    def _output_dtype(self, metas: list[TensorMeta], reference: int) -> torch.dtype:
        if self.float32_result and len(metas) > 1:  # one input: the method returns it unchanged
            computed = self.compute_dtype or functools.reduce(torch.promote_types, (m.dtype for m in metas))
            return torch.promote_types(computed, torch.float32)
        return self.output_dtype or metas[reference].dtype


def _describe(shape: list[int] | None) -> str:
    return "missing" if shape is None else f"shaped {shape}"


def output_config(plan: MergePlan, base_config: dict[str, Any]) -> dict[str, Any]:
    """The merged model's config.json: the base's, with the output dtype, the output layer count and the
    per-layer lists (e.g. ``layer_types``) following the layers they describe."""
    config = dict(base_config)
    dtype = plan.recipe.dtype or plan.recipe.compute_dtype
    if dtype:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    if plan.output_layers is None:
        return config
    old_layers = None
    for key in LAYER_COUNT_KEYS:
        if isinstance(config.get(key), int):
            old_layers = config[key]
            config[key] = plan.output_layers
            break
    if old_layers and list(plan.layer_origins) != list(range(old_layers)):
        for key, value in list(config.items()):
            if isinstance(value, list) and len(value) == old_layers and key != "architectures":
                config[key] = [value[i] if i < len(value) else value[-1] for i in plan.layer_origins]
    return config


def layout_from_manifest(manifest) -> dict[str, TensorMeta]:
    from alloy.merge.tensor_io import TORCH_DTYPES

    layout = {}
    for name, info in manifest.tensors.items():
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"tensor {name!r} has unsupported dtype {info.dtype}",
                {"tensor": name, "dtype": info.dtype},
            )
        layout[name] = TensorMeta(tuple(info.shape), dtype)
    return layout


def layout_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    return {name: TensorMeta(tuple(t.shape), t.dtype) for name, t in state_dict.items()}
