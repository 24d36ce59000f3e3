"""The maths of one output tensor: resolve its parameters, seed its generator, call the method's kernel.
Shared by the streaming executor and the in-memory merge, which is why both give the same bits.

Parameters resolve as mergekit resolves them: a shared parameter from the output slice, then the recipe's global
parameters; a per-input parameter from the slice source, the output slice, the model entry, then the global
parameters. The first level whose value applies to the tensor (a scalar, a gradient at the slice's ``t``, or the
first matching ``filter``) wins; a filter list that matches nothing falls through to the next level. Shared
parameters are matched against the output tensor's name, per-input ones against the input tensor's name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.methods import is_required, is_shared
from alloy.merge.plan import OUTPUT_DTYPES, MergePlan, TensorTask
from alloy.merge.recipe import parameter_error
from kernels.errors import InvalidParameterError, KernelError
from kernels.params import resolve_value
from kernels.vocabulary import align_vocabulary


def tensor_seed(seed: int, tensor_name: str) -> int:
    """A 63-bit seed from the merge seed and the tensor's name: independent of order and thread count."""
    digest = hashlib.blake2b(f"{seed}\x00{tensor_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _first(param, levels: Iterable[Mapping[str, Any] | None], tensor_name: str, t: float) -> Any:
    for level in levels:
        if level and param.name in level:
            value = resolve_value(level[param.name], tensor_name, t)
            if value is not None:
                return bool(value) if param.type is bool else float(value)
    return None


def resolve_task_parameters(plan: MergePlan, task: TensorTask) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(shared parameters, per-input parameters in task.sources order)`` for one output tensor."""
    recipe = plan.recipe
    piece = plan.slices[task.slice_index]
    shared: dict[str, Any] = {}
    per_input: list[dict[str, Any]] = [{} for _ in task.sources]
    for param in plan.method.params:
        if is_shared(param):
            value = _first(param, (piece.parameters, recipe.parameters), task.output_name, task.depth)
            if value is None and is_required(param):
                raise _missing(param.name, task.output_name)
            shared[param.name] = param.default if value is None else value
            continue
        for position, (model, name) in enumerate(task.sources):
            levels = (
                piece.sources[position].parameters,
                piece.parameters,
                recipe.model_parameters(model),
                recipe.parameters,
            )
            value = _first(param, levels, name, task.depth)
            # mergekit binds non-base parameters (weight, density...) to the other inputs only
            is_base = position == task.base_index and param.scope != "input"
            if value is None and is_required(param) and not is_base:
                raise _missing(param.name, f"{model}: {name}")
            per_input[position][param.name] = param.default if value is None else value
    return shared, per_input


def _missing(parameter: str, where: str) -> AlloyError:
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"parameter {parameter!r} is required and not set for {where}",
        {"parameter": parameter, "field": f"parameters.{parameter}"},
    )


def compute_dtype(plan: MergePlan, inputs: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype one tensor is computed in, mergekit's rule (its ``dtype`` key): the recipe's ``compute_dtype``;
    without one, a mergekit recipe computes in its inputs' promoted dtype (bfloat16 models stay bfloat16), while an
    Alloy-native recipe computes in float32 (None: the kernels' default)."""
    if plan.recipe.compute_dtype:
        return OUTPUT_DTYPES[plan.recipe.compute_dtype]
    if not plan.recipe.is_mergekit or not inputs:
        return None
    promoted = inputs[0].dtype
    for tensor in inputs[1:]:
        promoted = torch.promote_types(promoted, tensor.dtype)
    return promoted if promoted.is_floating_point else None


def compute_tensor(
    plan: MergePlan, task: TensorTask, inputs: list[torch.Tensor], *, device: str = "cpu", owned: bool = False
) -> torch.Tensor:
    """The output tensor (on the CPU, in ``task.dtype``) from the inputs in ``task.sources`` order.
    With ``owned`` the inputs are the caller's to give up, and kernels may reuse their memory. With a compute
    dtype other than float32 (:func:`compute_dtype`) the inputs are rounded to it first; a method mergekit computes
    in that dtype op for op (``computes_in_dtype``) is computed so by its kernel, any other in float32 and its
    result rounded to the compute dtype (what mergekit does for those: linear, slerp...). A ``float32_result``
    method's float32 result is kept as it is for ``task.dtype`` (the plan's choice, mergekit's rule)."""
    if not task.compute:
        return inputs[0].to(task.dtype)
    shared, per_input = resolve_task_parameters(plan, task)
    random = getattr(plan.method, "random", False)
    generator = torch.Generator().manual_seed(tensor_seed(plan.recipe.seed, task.output_name)) if random else None
    dtype = compute_dtype(plan, inputs)
    inputs = round_inputs(inputs, dtype)
    if task.vocabulary is not None:  # rows in output-vocabulary order, as the method must see them
        inputs = align_vocabulary(inputs, task.vocabulary)
    on_device = [t.to(device) for t in inputs] if device != "cpu" else inputs
    options = kernel_options(plan, dtype)
    out = call_kernel(
        task, plan.method.kernel, on_device, task.base_index, shared, per_input, generator, owned=owned, **options
    )
    return finish_output(plan, task, out, dtype)


def is_reduced(dtype: torch.dtype | None) -> bool:
    return dtype is not None and dtype != torch.float32


def round_inputs(inputs: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The inputs rounded to a reduced compute dtype (:func:`compute_dtype`), else as they are."""
    return [t.to(dtype) for t in inputs] if is_reduced(dtype) else inputs


def kernel_options(plan: MergePlan, dtype: torch.dtype | None) -> dict[str, Any]:
    return {"dtype": dtype} if is_reduced(dtype) and plan.method.computes_in_dtype else {}


def call_kernel(task: TensorTask, kernel: Callable[..., torch.Tensor], *args: Any, **options: Any) -> torch.Tensor:
    """``kernel(*args, **options)``, its refusals turned into the merge's validation errors."""
    try:
        return kernel(*args, **options)
    except InvalidParameterError as exc:
        raise parameter_error(exc) from None
    except KernelError as exc:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"{task.output_name}: {exc}", {"tensor": task.output_name}
        ) from None


def finish_output(plan: MergePlan, task: TensorTask, out: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A kernel's result as the output stores it: rounded to a reduced compute dtype unless the method keeps its
    float32 result, then on the CPU in ``task.dtype``."""
    if is_reduced(dtype) and not plan.method.float32_result:
        out = out.to(dtype)
    return out.to(device="cpu", dtype=task.dtype)
