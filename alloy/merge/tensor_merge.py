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
from collections.abc import Iterable, Mapping
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


def compute_tensor(
    plan: MergePlan, task: TensorTask, inputs: list[torch.Tensor], *, device: str = "cpu", owned: bool = False
) -> torch.Tensor:
    """The output tensor (on the CPU, in ``task.dtype``) from the inputs in ``task.sources`` order.
    With ``owned`` the inputs are the caller's to give up, and kernels may reuse their memory. With a compute
    dtype (mergekit's ``dtype``) the inputs are rounded to it first and the result rounded to it after."""
    if not task.compute:
        return inputs[0].to(task.dtype)
    shared, per_input = resolve_task_parameters(plan, task)
    random = getattr(plan.method, "random", False)
    generator = torch.Generator().manual_seed(tensor_seed(plan.recipe.seed, task.output_name)) if random else None
    compute_dtype = OUTPUT_DTYPES.get(plan.recipe.compute_dtype or "")
    if compute_dtype is not None:
        inputs = [t.to(compute_dtype) for t in inputs]
    if task.vocabulary is not None:  # rows in output-vocabulary order, as the method must see them
        inputs = align_vocabulary(inputs, task.vocabulary)
    on_device = [t.to(device) for t in inputs] if device != "cpu" else inputs
    try:
        out = plan.method.kernel(on_device, task.base_index, shared, per_input, generator, owned=owned)
    except InvalidParameterError as exc:
        raise parameter_error(exc) from None
    except KernelError as exc:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED, f"{task.output_name}: {exc}", {"tensor": task.output_name}
        ) from None
    if compute_dtype is not None:
        out = out.to(compute_dtype)
    return out.to(device="cpu", dtype=task.dtype)
