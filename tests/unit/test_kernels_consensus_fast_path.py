"""The float-only TIES sign consensus (kernels.ties.finite_sign_consensus_) gives the bits of the reference
sign_consensus on finite pieces (signed zeros, denormals, cancelling sums, zero and negative weights), hands back
None on non-finite pieces, and the chunked consensus of kernels.gta gives the reference bits on whole tensors."""

from __future__ import annotations

import pytest
import torch

from kernels import gta
from kernels.ties import finite_sign_consensus_, sign_consensus

FINITE = [0.0, -0.0, 1e-45, -1e-45, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3e38, -3e38]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def draw(values: list[float], n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), (n,), generator=generator)]


@pytest.mark.parametrize("lam, normalize", [(1.0, True), (0.7, False), (2.0, True)])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, -1.0, 0.5], [0.0, 2.0], [1.0], [0.5, -0.5, 1.0, 1.0]])
def test_finite_pieces_give_the_reference_bits(weights, lam, normalize):
    generator = torch.Generator().manual_seed(len(weights))
    for _ in range(20):
        deltas = [draw(FINITE, 3000, generator) * weight for weight in weights]
        base = draw(FINITE, 3000, generator)
        expected = sign_consensus(base, [d.clone() for d in deltas], weights, lam, normalize)
        got = finite_sign_consensus_(base, [d.clone() for d in deltas], weights, lam, normalize)
        if got is None:  # an elected sum overflowed: the caller takes the reference path
            continue
        assert torch.equal(bits(got), bits(expected))


def test_hand_computed_piece():
    # elected sums: 1, +0 (cancel: + wins), -0 (all -0: nobody agrees), -1
    deltas = [
        torch.tensor([1.0, 1.0, -0.0, -1.0]),
        torch.tensor([-0.5, -1.0, -0.0, 0.5]),
        torch.tensor([0.5, 0.0, -0.0, -0.5]),
    ]
    base = torch.tensor([10.0, 10.0, -0.0, 10.0])
    got = finite_sign_consensus_(base, [d.clone() for d in deltas], [1.0, 1.0, 1.0], 1.0, True)
    assert got is not None
    assert got.tolist() == [10.75, 11.0, 0.0, 9.25]
    assert bits(got)[2] == bits(torch.tensor(-0.0))  # -0 base plus the dropped -0 deltas (-0 * 0 = -0) stays -0


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_pieces_are_left_untouched(special):
    deltas = [torch.tensor([1.0, special]), torch.tensor([2.0, 1.0])]
    copies = [d.clone() for d in deltas]
    assert finite_sign_consensus_(torch.zeros(2), copies, [1.0, 1.0], 1.0, True) is None
    assert all(torch.equal(bits(c), bits(d)) for c, d in zip(copies, deltas))


def test_overflowing_sum_is_left_to_the_reference():
    deltas = [torch.tensor([3e38]), torch.tensor([3e38])]
    assert finite_sign_consensus_(torch.zeros(1), deltas, [1.0, 1.0], 1.0, True) is None


@pytest.mark.parametrize("normalize", [True, False])
def test_chunked_consensus_matches_the_reference_with_non_finite_pieces(normalize):
    generator = torch.Generator().manual_seed(7)
    n = 3 * gta.CONSENSUS_CHUNK + 5
    deltas = [torch.randn(n, generator=generator) for _ in range(3)]
    deltas[0][gta.CONSENSUS_CHUNK + 3] = float("inf")  # the second piece takes the reference path
    deltas[2][-1] = float("nan")
    base = torch.randn(n, generator=generator)
    expected = sign_consensus(base, [d.clone() for d in deltas], [1.0, 0.5, 2.0], 0.9, normalize)
    got = gta._chunked_consensus(base, [d.clone() for d in deltas], [1.0, 0.5, 2.0], 0.9, normalize)
    assert torch.equal(bits(got), bits(expected))


def merge(models, params, sparsifier, base=None, normalize=True, lam=1.0):
    base = torch.zeros_like(models[0]) if base is None else base
    return gta.generalized_task_arithmetic(
        base, models, params, sparsifier=sparsifier, consensus=True, normalize=normalize, rescale=False, lam=lam
    )


def test_ties_hand_computed():
    models = [torch.tensor([3.0, -1.0, 2.0, 0.5]), torch.tensor([-2.0, 1.0, 1.0, 0.25])]
    # trims (density 0.5: 2 of 4, equal magnitudes: the earlier first): [3, 0, 2, 0] and [-2, 1, 0, 0]
    params = [{"weight": 1.0, "density": 0.5}, {"weight": 1.0, "density": 0.5}]
    assert merge(models, params, "magnitude").tolist() == [3.0, 1.0, 2.0, 0.0]
    params[1]["weight"] = 2.0  # weighted: [-4, 2, 0, 0]; the sign of entry 0 flips to -
    assert merge(models, params, "magnitude").tolist() == [-2.0, 1.0, 2.0, 0.0]
