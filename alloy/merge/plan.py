"""From a validated recipe and the models' tensor layouts to the list of output tensors and how to make each.

The plan is built from shapes and dtypes only, so the on-disk merge (layouts from safetensors headers) and the
in-memory merge (layouts from state dicts) share it and produce the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.recipe import MergeRecipe, parameter_error, strategy_spec
from kernels.errors import InvalidParameterError
from kernels.franken import LayerSlice, output_layer_count, plan_franken
from kernels.params import depth_of, layer_index
from kernels.registry import StrategySpec

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
    sources: tuple[tuple[str, str], ...]  # (model id, source tensor name), in the plan's model order
    shape: tuple[int, ...]
    dtype: torch.dtype  # output dtype
    depth: float  # t in [0, 1] for gradient parameters
    compute: bool  # False: the first source is copied (franken slices, integer buffers)
    input_bytes: int  # float32 bytes of the inputs and result: what the scheduler budgets


@dataclass(frozen=True)
class MergePlan:
    recipe: MergeRecipe  # validated, canonical parameter names
    spec: StrategySpec
    model_ids: tuple[str, ...]
    base_index: int
    model_params: tuple[dict[str, Any], ...]  # aligned with model_ids
    tasks: tuple[TensorTask, ...]
    output_layers: int | None  # franken: the new layer count

    @property
    def base_id(self) -> str:
        return self.model_ids[self.base_index]


def count_layers(names: list[str] | Any) -> int:
    indices = [i for i in (layer_index(n) for n in names) if i is not None]
    return max(indices) + 1 if indices else 0


def natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in name.replace("-", ".").split(".")]


def build_plan(recipe: MergeRecipe, layouts: Mapping[str, Layout]) -> MergePlan:
    """``recipe`` must already have passed :func:`alloy.merge.recipe.validate_recipe` and the layouts
    :func:`alloy.merge.compatibility.check_layouts`."""
    spec = strategy_spec(recipe.strategy)
    model_ids = tuple(recipe.model_ids)
    base_index = model_ids.index(recipe.base)
    model_params = tuple(recipe.model_parameters(m) for m in model_ids)
    output_dtype = OUTPUT_DTYPES[recipe.dtype] if recipe.dtype else None
    if recipe.strategy == "franken_merge":
        tasks, layers = _franken_tasks(recipe, layouts, output_dtype)
    else:
        tasks, layers = _merge_tasks(model_ids, base_index, layouts, output_dtype), None
    return MergePlan(recipe, spec, model_ids, base_index, model_params, tasks, layers)


def _merge_tasks(model_ids, base_index, layouts, output_dtype) -> tuple[TensorTask, ...]:
    base_layout = layouts[model_ids[base_index]]
    num_layers = count_layers(base_layout)
    tasks = []
    for name in sorted(base_layout, key=natural_key):
        meta = base_layout[name]
        floating = meta.dtype.is_floating_point
        tasks.append(TensorTask(
            output_name=name,
            sources=tuple((m, name) for m in model_ids) if floating else ((model_ids[base_index], name),),
            shape=meta.shape,
            dtype=(output_dtype or meta.dtype) if floating else meta.dtype,
            depth=depth_of(name, num_layers),
            compute=floating,
            # inputs plus the float32 result: what a kernel holds at least
            input_bytes=meta.numel * 4 * (len(model_ids) + 1 if floating else 1),
        ))
    return tuple(tasks)


def _franken_tasks(recipe, layouts, output_dtype) -> tuple[tuple[TensorTask, ...], int]:
    slices = [LayerSlice(s.model, s.layer_range[0], s.layer_range[1]) for s in recipe.slices or []]
    try:
        sources = plan_franken(
            slices,
            {m: sorted(layout, key=natural_key) for m, layout in layouts.items()},
            {m: count_layers(layout) for m, layout in layouts.items()},
        )
    except InvalidParameterError as exc:
        raise parameter_error(exc) from None
    tasks = []
    for source in sources:
        meta = layouts[source.model][source.source_name]
        floating = meta.dtype.is_floating_point
        tasks.append(TensorTask(
            output_name=source.output_name,
            sources=((source.model, source.source_name),),
            shape=meta.shape,
            dtype=(output_dtype or meta.dtype) if floating else meta.dtype,
            depth=0.0,
            compute=False,
            input_bytes=meta.numel * 4,
        ))
    return tuple(tasks), output_layer_count(slices)


def output_config(plan: MergePlan, base_config: dict[str, Any]) -> dict[str, Any]:
    """The merged model's config.json: the base's, with the output dtype and (franken) the new layer count."""
    config = dict(base_config)
    if plan.recipe.dtype:
        config["dtype"] = plan.recipe.dtype
        config.pop("torch_dtype", None)
    if plan.output_layers is not None:
        old_layers = None
        for key in LAYER_COUNT_KEYS:
            if isinstance(config.get(key), int):
                old_layers = config[key]
                config[key] = plan.output_layers
                break
        # Per-layer lists (e.g. ``layer_types``) follow the layers they describe.
        source_layers = [i for s in plan.recipe.slices or [] for i in range(*s.layer_range)]
        for key, value in list(config.items()):
            if isinstance(value, list) and old_layers and len(value) == old_layers and key != "architectures":
                config[key] = [value[i] if i < len(value) else value[-1] for i in source_layers]
    return config


def layout_from_manifest(manifest) -> dict[str, TensorMeta]:
    from alloy.merge.tensor_io import TORCH_DTYPES

    layout = {}
    for name, info in manifest.tensors.items():
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"tensor {name!r} has unsupported dtype {info.dtype}",
                             {"tensor": name, "dtype": info.dtype})
        layout[name] = TensorMeta(tuple(info.shape), dtype)
    return layout


def layout_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    return {name: TensorMeta(tuple(t.shape), t.dtype) for name, t in state_dict.items()}
