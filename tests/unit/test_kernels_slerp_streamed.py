"""Slerp in place and in pieces: the same bits as the whole-tensor formula, with no third tensor-sized buffer."""

from __future__ import annotations

import pytest
import torch

from kernels.reductions import CHUNK, GramSums, stable_gram
from kernels.slerp import blend, merge, slerp, slerp_coefficients, streamed_coefficients


def pair(numel: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    v0 = torch.randn(numel, generator=generator) * 0.02
    return v0, v0 + torch.randn(numel, generator=generator) * 0.01


def reference(v0: torch.Tensor, v1: torch.Tensor, t: float) -> torch.Tensor:
    """The formula as it stood before slerp wrote in place: a third tensor for the result."""
    c0, c1 = slerp_coefficients(v0, v1, t)
    out = v0 * c0
    out.add_(v1, alpha=c1)
    return out


def test_owned_slerp_writes_into_the_base_and_keeps_the_bits():
    v0, v1 = pair(10_000)
    expected = reference(v0, v1, 0.3)
    address = v0.data_ptr()
    out = merge([v0, v1], 0, {"t": 0.3}, [{}, {}], None, owned=True)
    assert out.data_ptr() == address  # no third tensor: the result is the base's own buffer
    assert torch.equal(out, expected)


def test_slerp_not_owned_leaves_its_inputs_alone():
    v0, v1 = pair(10_000)
    before = v0.clone()
    out = slerp(v0, v1, 0.3)
    assert out.data_ptr() != v0.data_ptr() and torch.equal(v0, before)
    assert torch.equal(out, reference(v0, v1, 0.3))


def test_a_converted_copy_is_used_in_place_and_the_input_is_untouched():
    v0, v1 = (t.to(torch.bfloat16) for t in pair(10_000))
    before = v0.clone()
    out = slerp(v0, v1, 0.6)
    assert torch.equal(v0, before)
    assert torch.equal(out, reference(v0.float(), v1.float(), 0.6))


def test_the_same_tensor_twice_is_not_overwritten_while_read():
    v0, _ = pair(1000)
    expected = reference(v0, v0, 0.5)
    assert torch.equal(slerp(v0, v0, 0.5, owned=True), expected)


@pytest.mark.parametrize("piece", [CHUNK, 2 * CHUNK])
def test_streamed_gram_and_result_are_the_whole_tensors_bits(piece):
    numel = 2 * CHUNK + CHUNK // 2 + 37  # several chunks, a ragged last piece, more partials than one row
    v0, v1 = pair(numel, seed=1)
    starts = range(0, numel, piece)
    sums = GramSums()
    for start in starts:
        sums.add(v0[start : start + piece], v1[start : start + piece])
    assert sums.totals() == stable_gram(v0, v1)
    c0, c1 = streamed_coefficients(((v0[s : s + piece], v1[s : s + piece]) for s in starts), 0.4)
    assert (c0, c1) == slerp_coefficients(v0, v1, 0.4)
    pieces = [blend(v0[s : s + piece].clone(), v1[s : s + piece], c0, c1, in_place=True) for s in starts]
    assert torch.equal(torch.cat(pieces), reference(v0, v1, 0.4))


def test_a_ragged_piece_must_be_the_last():
    sums = GramSums()
    sums.add(torch.ones(10), torch.ones(10))
    with pytest.raises(ValueError):
        sums.add(torch.ones(10), torch.ones(10))


def test_gram_sums_keep_their_float64_scratch_for_every_piece():
    """Fresh float64 chunks per piece cost their page faults on every piece (a streamed slerp took 3x the time of
    the same tensor merged whole): one set serves every piece, and the sums are the whole tensor's bits."""
    a, b = pair(3 * CHUNK + 5, seed=4)
    sums = GramSums()
    sums.add(a[:CHUNK], b[:CHUNK])
    addresses = [buffer.data_ptr() for buffer in sums._buffers]
    sums.add(a[CHUNK : 3 * CHUNK], b[CHUNK : 3 * CHUNK])
    sums.add(a[3 * CHUNK :], b[3 * CHUNK :])
    assert [buffer.data_ptr() for buffer in sums._buffers] == addresses
    assert sums.totals() == stable_gram(a, b)
