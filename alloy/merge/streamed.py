"""One large output tensor merged piece by piece: inputs read a piece at a time from their files, each result piece
written at its offset in the preallocated output shard, so that the working set is a piece, not the tensor.

Only for methods whose result element ``i`` depends on element ``i`` of the inputs and at most on whole-tensor
sums (:data:`STREAMED_METHODS`): task arithmetic and linear call their own kernel on each piece (elementwise, so
the same bits); slerp takes two passes, its gram sums over the pieces first (:func:`kernels.slerp.
streamed_coefficients`, the same bits as the whole tensor's), then ``c0 * v0 + c1 * v1`` piece by piece. Every
piece goes through the very steps :func:`alloy.merge.tensor_merge.compute_tensor` applies to the whole tensor
(rounding to a reduced compute dtype, the output's rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from alloy.merge.lora import TensorReader, split_reference
from alloy.merge.plan import MergePlan, TensorTask
from alloy.merge.tensor_io import SafetensorsReader, ShardedWriter
from alloy.merge.tensor_merge import (
    call_kernel,
    compute_dtype,
    finish_output,
    kernel_options,
    resolve_task_parameters,
    round_inputs,
)
from kernels import slerp
from kernels.reductions import CHUNK

# Elements per piece: a multiple of the gram sums' chunk (so that streamed sums are the whole tensor's bits) and
# large enough that the per-piece Python costs nothing next to the arithmetic (4 MiB per float32 input).
PIECE_ELEMENTS = CHUNK
# A tensor this large (elements) or larger is streamed; a smaller one is read whole (one pass over its inputs).
STREAM_MIN_ELEMENTS = 4 * CHUNK
STREAMED_METHODS = frozenset({"slerp", "task_arithmetic", "linear"})
# Passes a streamed method reads its inputs in (the dry run's time estimate counts each): slerp's gram sums, then
# its blend; the others one.
READ_PASSES = {"slerp": 2}

Pieces = Callable[[int, int], list[torch.Tensor]]  # (start, count) -> the inputs' elements, flat, in sources order


def streams(plan: MergePlan, task: TensorTask) -> bool:
    """Whether the executor streams ``task`` (on the CPU): a computed tensor of a
    streamed method, at least :data:`STREAM_MIN_ELEMENTS` large, whose rows are not realigned to a new vocabulary
    (that reorders whole rows first), read from plain
    models (a ``base+adapter`` model adds its adapter's delta to whole tensors)."""
    numel = 1
    for size in task.shape:
        numel *= size
    return (
        task.compute
        and plan.method.name in STREAMED_METHODS
        and task.vocabulary is None
        and numel >= STREAM_MIN_ELEMENTS
        and not getattr(plan.method, "random", False)
        and all(split_reference(model)[1] is None for model, _ in task.sources)
    )


def read_passes(plan: MergePlan, task: TensorTask) -> int:
    """How many times the executor reads ``task``'s inputs: whole tensors once, streamed ones READ_PASSES."""
    return READ_PASSES.get(plan.method.name, 1) if streams(plan, task) else 1


def can_read_pieces(readers: Mapping[str, TensorReader], task: TensorTask) -> bool:
    """Whether every input of ``task`` can be read in pieces (plain safetensors files)."""
    return all(isinstance(readers[model], SafetensorsReader) for model, _ in task.sources)


def merge_streamed(
    plan: MergePlan, task: TensorTask, readers: Mapping[str, TensorReader], writer: ShardedWriter
) -> int:
    """Compute ``task`` piece by piece into its slot of ``writer``; returns the bytes written."""
    numel = writer.slots[task.output_name].nbytes // task.dtype.itemsize
    files = [(_plain(readers[model]), name) for model, name in task.sources]

    def read(start: int, count: int) -> list[torch.Tensor]:
        return [reader.read_range(name, start, count) for reader, name in files]

    shared, per_input = resolve_task_parameters(plan, task)
    dtype = compute_dtype(plan, read(0, 0))
    if plan.method.name == "slerp":
        base = task.base_index or 0
        pairs = ((p[base], p[1 - base]) for p in _float32_pieces(read, numel, dtype))
        c0, c1 = slerp.streamed_coefficients(pairs, float(shared["t"]))

        def kernel(inputs: list[torch.Tensor]) -> torch.Tensor:
            v0, v1 = (t.to(torch.float32) for t in (inputs[base], inputs[1 - base]))
            return slerp.blend(v0, v1, c0, c1, in_place=True)
    else:
        options = kernel_options(plan, dtype)

        def kernel(inputs: list[torch.Tensor]) -> torch.Tensor:
            return plan.method.kernel(inputs, task.base_index, shared, per_input, None, owned=True, **options)

    written = 0
    for start in range(0, numel, PIECE_ELEMENTS):
        inputs = round_inputs(read(start, min(PIECE_ELEMENTS, numel - start)), dtype)
        out = finish_output(plan, task, call_kernel(task, kernel, inputs), dtype)
        del inputs
        written += writer.write_range(task.output_name, start, out)
    return written


def _float32_pieces(read: Pieces, numel: int, dtype: torch.dtype | None) -> Iterator[list[torch.Tensor]]:
    """The inputs piece by piece as the kernel sees them: rounded to the compute dtype, then float32."""
    for start in range(0, numel, PIECE_ELEMENTS):
        pieces = round_inputs(read(start, min(PIECE_ELEMENTS, numel - start)), dtype)
        yield [t.to(torch.float32) for t in pieces]


def _plain(reader: TensorReader) -> SafetensorsReader:
    if not isinstance(reader, SafetensorsReader):
        raise TypeError("only plain safetensors models are read in pieces (see can_read_pieces)")
    return reader
