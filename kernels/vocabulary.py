"""Row alignment of vocabulary tensors (embeddings, LM heads) to one output vocabulary, before a merge method sees
them: each input's row ``r`` becomes the row of output token ``r`` in that input, or a fill row when the input
lacks the token (or a token's source is forced), as mergekit 0.1.5 aligns them.

A fill is the sum, in order and starting from zeros, of its contributing rows divided by their count: the
average of the inputs that have the token, one donor's row, or zeros (no contribution). Rows past the tokens
(``pad_to_multiple_of``) are the mean of each input's token rows. The vocabulary axis is the first one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import torch

from kernels.errors import KernelError


@dataclass(frozen=True)
class VocabularyAlignment:
    """``own[p][r]``: the row of output token ``r`` in input ``p``, or -1 (the token's fill, else zeros).
    ``fill_rows[f]``: the output row of fill ``f``; ``fill_sources[f]``: its ``(input, row)`` contributions."""

    rows: int  # output rows, padding included
    used: int  # rows that are tokens
    own: tuple[tuple[int, ...], ...]
    fill_rows: tuple[int, ...] = ()
    fill_sources: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self) -> None:
        if self.rows < self.used or any(len(rows) != self.used for rows in self.own):
            raise KernelError("vocabulary alignment: every input maps each token row; rows >= tokens")
        if len(self.fill_rows) != len(self.fill_sources):
            raise KernelError("vocabulary alignment: one source list per fill row")


def _fill_values(inputs: list[torch.Tensor], alignment: VocabularyAlignment, dtype: torch.dtype) -> torch.Tensor:
    width = inputs[0].shape[1:]
    fills = torch.zeros((len(alignment.fill_rows), *width), dtype=dtype)
    steps = max((len(sources) for sources in alignment.fill_sources), default=0)
    for step in range(steps):  # one contribution of every fill per step: the same additions, in the same order
        for position, tensor in enumerate(inputs):
            picks = [
                (f, sources[step][1])
                for f, sources in enumerate(alignment.fill_sources)
                if len(sources) > step and sources[step][0] == position
            ]
            if picks:
                index = torch.tensor([f for f, _ in picks])
                rows = torch.tensor([r for _, r in picks])
                fills[index] = fills[index] + tensor[rows]
    counts = torch.tensor([len(sources) for sources in alignment.fill_sources])
    averaged = (counts > 1).nonzero().flatten()
    if len(averaged):
        fills[averaged] = fills[averaged] / counts[averaged].to(dtype).view(-1, *([1] * len(width)))
    return fills


def align_vocabulary(inputs: list[torch.Tensor], alignment: VocabularyAlignment) -> list[torch.Tensor]:
    """The inputs with their rows in output-vocabulary order (in the inputs' promoted dtype)."""
    if len(inputs) != len(alignment.own):
        raise KernelError(f"vocabulary alignment is for {len(alignment.own)} inputs, got {len(inputs)}")
    if any(t.dim() == 0 or t.shape[1:] != inputs[0].shape[1:] for t in inputs):
        raise KernelError(f"vocabulary tensors differ beyond their rows: {[list(t.shape) for t in inputs]}")
    dtype = reduce(torch.promote_types, (t.dtype for t in inputs))
    fills = _fill_values(inputs, alignment, dtype)
    fill_rows = torch.tensor(alignment.fill_rows, dtype=torch.long)
    out = []
    for position, tensor in enumerate(inputs):
        own = torch.tensor(alignment.own[position], dtype=torch.long)
        if len(own) and int(own.max()) >= tensor.shape[0]:
            raise KernelError(f"input {position} has {tensor.shape[0]} rows, the alignment reads row {int(own.max())}")
        aligned = torch.zeros((alignment.rows, *tensor.shape[1:]), dtype=dtype)
        have = (own >= 0).nonzero().flatten()
        aligned[have] = tensor[own[have]].to(dtype)
        if len(fill_rows):
            lacking = (own[fill_rows] < 0).nonzero().flatten()
            aligned[fill_rows[lacking]] = fills[lacking]
        if alignment.rows > alignment.used:
            aligned[alignment.used :] = torch.mean(aligned[: alignment.used], dim=0)
        out.append(aligned)
    return out
