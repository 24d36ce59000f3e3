"""SCE by pieces (contiguous CPU tensors: the streaming merge's case) gives the whole-tensor SCE's bits: its steps
are elementwise except the variance's top-k and the weights, which both still see whole tensors."""

from __future__ import annotations

import pytest
import torch

from kernels import sce as sce_module
from kernels.sce import sce_by_pieces, sce_whole


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def family(numel: int, seed: int, specials: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=generator)
    # few distinct values: ties in the variance at the top-k threshold, zeros, signs that cancel
    models = [base + torch.randint(-2, 3, (numel,), generator=generator).float() * 0.5 for _ in range(3)]
    if specials:
        models[0][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
        models[1][4] = float("nan")
    return base, models


SIZES = [
    (1, False),
    (7, False),
    (32000, False),
    (32000, True),
    (100_003, False),
    (100_003, True),
]  # specials: 5 entries


@pytest.mark.parametrize("select_topk", [0.0, 0.1, 0.5, 1 / 3, 0.999, 1.0, 1.5, -0.2])
@pytest.mark.parametrize(("numel", "specials"), SIZES)
def test_pieces_give_the_whole_tensor_bits(monkeypatch, select_topk, numel, specials):
    monkeypatch.setattr(sce_module, "PIECE", 1000)  # pieces cut through the tie runs
    base, models = family(numel, numel, specials)
    whole = sce_whole(base, [m - base for m in models], select_topk)
    pieces = sce_by_pieces(base, [m - base for m in models], select_topk)
    assert torch.equal(bits(pieces), bits(whole))


def test_sce_takes_the_pieces_path_for_contiguous_cpu_inputs_and_the_whole_one_otherwise(monkeypatch):
    base, models = family(5000, 1, False)
    taken = []
    monkeypatch.setattr(sce_module, "sce_by_pieces", lambda *a: taken.append("pieces") or sce_whole(*a))
    sce_module.sce(base, [m.clone() for m in models], 0.5)
    strided = [torch.stack([m, m], dim=1)[:, 0] for m in models]  # non-contiguous views
    sce_module.sce(base, strided, 0.5, owned=True)
    assert taken == ["pieces"]


def test_hand_computed_select_and_erase():
    # deltas per entry (3 models): e0 = (1, 1, 1) variance 0; e1 = (2, -2, 0) variance 8/3; e2 = (3, 0, 0) variance 2
    # nonzero variances: 2, so select_topk 0.5 keeps k = 1 entry: e1. weights: mean squares 4/3, 4/3, 0 -> 1/2, 1/2, 0.
    # e1: elected sign = sign(0) -> positive; agreeing: model 0 (2 > 0); merged change = (0.5 * 2) / 0.5 = 2.
    base = torch.zeros(3)
    models = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, -2.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])]
    got = sce_module.sce(base, models, 0.5)
    assert got.tolist() == [0.0, 2.0, 0.0]


FINITE = [0.0, -0.0, 1e-45, -1e-45, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3e38, -3e38]


@pytest.mark.parametrize("weights", [[0.5, 0.25, 0.25], [1.0, -1.0, 0.5], [0.0, 1.0], [1.0], [0.2, 0.3, 0.0, 0.5]])
def test_the_float_only_erase_gives_the_reference_bits_on_finite_pieces(weights):
    """Signed zeros, denormals, sums that cancel or overflow, zero and negative weights: the float-only erase
    answers with erase's bits, or None (overflowed or non-finite sums) for the caller to take erase."""
    generator = torch.Generator().manual_seed(len(weights))
    answered = 0
    for trial in range(200):
        values = torch.tensor(FINITE if trial % 2 else FINITE[:-2])  # with 3e38, most pieces' sums overflow
        pick = [torch.randint(len(values), (16,), generator=generator) for _ in weights]
        deltas = [values[p] for p in pick]
        base = values[torch.randint(len(values), (16,), generator=generator)]
        fast = sce_module.finite_erase([d.clone() for d in deltas], weights, base)
        if fast is None:
            continue
        answered += 1
        assert torch.equal(bits(fast), bits(sce_module.erase([d.clone() for d in deltas], weights, base)))
    assert answered > 100
    infinite = [torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0])]
    assert sce_module.finite_erase(infinite, [0.5, 0.5], torch.zeros(2)) is None
