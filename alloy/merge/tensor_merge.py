"""The maths of one output tensor: resolve its parameters, seed its generator, call the strategy's kernel.
Shared by the streaming executor and the in-memory merge, which is why both give the same bits."""

from __future__ import annotations

import hashlib

import torch

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.plan import MergePlan, TensorTask
from alloy.merge.recipe import parameter_error
from kernels.errors import InvalidParameterError, KernelError
from kernels.registry import resolve_for_tensor


def tensor_seed(seed: int, tensor_name: str) -> int:
    """A 63-bit seed from the merge seed and the tensor's name: independent of order and thread count."""
    digest = hashlib.blake2b(f"{seed}\x00{tensor_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def compute_tensor(plan: MergePlan, task: TensorTask, inputs: list[torch.Tensor], *, device: str = "cpu",
                   owned: bool = False) -> torch.Tensor:
    """The output tensor (on the CPU, in ``task.dtype``) from the inputs in ``task.sources`` order.
    With ``owned`` the inputs are the caller's to give up, and kernels may reuse their memory."""
    if not task.compute:
        return inputs[0].to(task.dtype)
    global_params, model_params = resolve_for_tensor(
        plan.spec, plan.recipe.parameters, plan.model_params, task.output_name, task.depth)
    generator = torch.Generator().manual_seed(tensor_seed(plan.recipe.seed, task.output_name)) if plan.spec.random else None
    on_device = [t.to(device) for t in inputs] if device != "cpu" else inputs
    try:
        out = plan.spec.kernel(on_device, plan.base_index, global_params, model_params, generator, owned=owned)
    except InvalidParameterError as exc:
        raise parameter_error(exc) from None
    except KernelError as exc:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"{task.output_name}: {exc}", {"tensor": task.output_name}) from None
    return out.to(device="cpu", dtype=task.dtype)
