"""The Alloy-only subspace merges, TSV-M (``tsv``) and Iso-C / Iso-CTS (``iso_c``, ``iso_cts``), through
``kernels.registry.METHODS``: each pinned on small matrices against the paper's formula written out plainly here
(numpy, float64), plus the edge cases (zero and rank-deficient task matrices, 1-D tensors, one task)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.registry import ALLOY_ONLY_METHODS, METHODS, get_method

SUBSPACE = ("tsv", "iso_c", "iso_cts")


def _family(shape=(6, 4), tasks=3, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape, generator=g)
    return [base] + [base + scale * torch.randn(*shape, generator=g) for _ in range(tasks)]


def _merge(method, tensors, weights=None, **global_params):
    spec = get_method(method)
    params = {p.name: p.default for p in spec.params if p.scope == "global"}
    params.update(global_params)
    models = [{}] + [{"weight": w} for w in (weights or [1.0] * (len(tensors) - 1))]
    return spec.kernel(tensors, 0, params, models, None)


def _deltas(tensors):
    base = tensors[0].double().numpy()
    return base, [t.double().numpy() - base for t in tensors[1:]]


def _polar(a):
    p, _, qt = np.linalg.svd(a, full_matrices=False)
    return p @ qt


# --- the papers' formulas, written plainly ----------------------------------------------------------------------


def tsv_reference(tensors, alpha=1.0):
    base, deltas = _deltas(tensors)
    k = math.floor(min(base.shape) / len(deltas))
    us, ss, vts = [], [], []
    for d in deltas:
        u, s, vt = np.linalg.svd(d, full_matrices=False)
        us.append(u[:, :k]), ss.append(s[:k]), vts.append(vt[:k])
    u_perp, v_perp = _polar(np.hstack(us)), _polar(np.vstack(vts).T)
    return base + alpha * u_perp @ np.diag(np.concatenate(ss)) @ v_perp.T


def iso_c_reference(tensors, alpha=1.0):
    base, deltas = _deltas(tensors)
    u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
    return base + alpha * s.mean() * u @ vt


def iso_cts_reference(tensors, common_fraction=0.8, alpha=1.0):
    base, deltas = _deltas(tensors)
    full, tasks = min(base.shape), len(deltas)
    common = int(full * common_fraction)
    per_task = round((full - common) / tasks)
    common = full - per_task * tasks
    u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
    uc, vtc = u[:, :common], vt[:common]
    us, vts = [uc], [vtc]
    for d in deltas:
        ut, _, vtt = np.linalg.svd(d - uc @ uc.T @ d, full_matrices=False)
        us.append(ut[:, :per_task]), vts.append(vtt[:per_task])
    u_perp, v_perp = _polar(np.hstack(us)), _polar(np.vstack(vts).T)
    return base + alpha * s[:common].mean() * u_perp @ v_perp.T


def _close(ours, reference, atol=1e-5):
    assert ours.dtype == torch.float32
    np.testing.assert_allclose(ours.double().numpy(), reference, atol=atol, rtol=0)


# --- pinned against the formulas --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (12, 9)])
def test_tsv_matches_the_papers_formula(shape):
    tensors = _family(shape)
    _close(_merge("tsv", tensors), tsv_reference(tensors))
    _close(_merge("tsv", tensors, **{"lambda": 0.7}), tsv_reference(tensors, alpha=0.7))


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (12, 9)])
def test_iso_c_matches_the_papers_formula(shape):
    tensors = _family(shape)
    _close(_merge("iso_c", tensors), iso_c_reference(tensors))
    _close(_merge("iso_c", tensors, **{"lambda": 1.5}), iso_c_reference(tensors, alpha=1.5))


@pytest.mark.parametrize(("shape", "fraction"), [((6, 4), 0.5), ((12, 9), 0.8), ((12, 9), 0.4), ((10, 10), 0.2)])
def test_iso_cts_matches_the_papers_algorithm(shape, fraction):
    tensors = _family(shape)
    _close(_merge("iso_cts", tensors, common_fraction=fraction), iso_cts_reference(tensors, fraction))


def test_iso_c_flattens_the_spectrum_of_the_summed_change():
    tensors = _family((12, 9))
    change = (_merge("iso_c", tensors) - tensors[0]).double()
    s = torch.linalg.svdvals(change)
    total = sum(t.double() - tensors[0].double() for t in tensors[1:])
    assert torch.allclose(s, torch.full_like(s, float(torch.linalg.svdvals(total).mean())), atol=1e-5)


def test_tsv_whitens_the_task_directions():
    # two tasks sharing a direction: the concatenated U is not orthonormal, the merged one is
    tensors = _family((8, 8), tasks=2)
    change = (_merge("tsv", tensors) - tensors[0]).double()
    u, s, _ = torch.linalg.svd(change)
    base, deltas = _deltas(tensors)
    kept = np.concatenate([np.linalg.svd(d)[1][:4] for d in deltas])
    np.testing.assert_allclose(np.sort(s.numpy()), np.sort(kept), atol=1e-5)  # S survives, directions whitened


def test_weights_scale_each_task_vector_before_the_decomposition():
    tensors = _family((6, 4))
    base = tensors[0]
    scaled = [base] + [base + 2.0 * (t - base) for t in tensors[1:2]] + tensors[2:]
    for method in SUBSPACE:
        assert torch.allclose(_merge(method, tensors, weights=[2.0, 1.0, 1.0]), _merge(method, scaled), atol=1e-5)


# --- edge cases -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", SUBSPACE)
def test_zero_task_vectors_give_the_base(method):
    base = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_merge(method, [base, base.clone(), base.clone(), base.clone()]), base)


@pytest.mark.parametrize("method", SUBSPACE)
def test_one_non_zero_task_among_zeros(method):
    tensors = _family((6, 4), tasks=1)
    out = _merge(method, [tensors[0], tensors[1], tensors[0].clone()])
    assert torch.isfinite(out).all() and not torch.equal(out, tensors[0])


def test_rank_one_changes_keep_only_real_directions():
    # Every task matrix (and their sum) has rank 1: the other singular vectors are arbitrary and must not leak in.
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6, 4, generator=g)
    u, v = torch.randn(6, 1, generator=g), torch.randn(1, 4, generator=g)
    tensors = [base, base + u @ v, base + 2 * u @ v, base + 0.5 * u @ v]
    total = 3.5 * u @ v
    assert torch.allclose(_merge("iso_c", tensors), base + total, atol=1e-5)  # one direction: its own mean
    assert torch.allclose(_merge("iso_cts", tensors), base + total, atol=1e-5)
    # TSV-M keeps each task's one direction; the polar factor of the three copies [u u u]/|u| (rank 1: only its
    # one real direction) is [u u u]/(|u| sqrt 3), so the change is (sum of the S) / 3 along u v^T.
    assert torch.allclose(_merge("tsv", tensors), base + total / 3, atol=1e-5)


@pytest.mark.parametrize("method", SUBSPACE)
def test_one_dimensional_tensors_get_the_mean_task_vector(method):
    tensors = [t.reshape(-1) for t in _family((6, 4))]
    mean = sum(t - tensors[0] for t in tensors[1:]) / 3
    assert torch.allclose(_merge(method, tensors, **{"lambda": 0.5}), tensors[0] + 0.5 * mean, atol=1e-6)
    three_d = [t.reshape(2, 3, 4) for t in _family((6, 4))]
    assert _merge(method, three_d).shape == (2, 3, 4)


def test_one_task():
    tensors = _family((6, 4), tasks=1)
    base, (delta,) = _deltas(tensors)
    # TSV-M with one task keeps every triplet; whitening orthonormal vectors changes nothing
    _close(_merge("tsv", tensors), base + delta)
    _close(_merge("iso_c", tensors), iso_c_reference(tensors))
    _close(_merge("iso_cts", tensors), iso_cts_reference(tensors))


@pytest.mark.parametrize("method", SUBSPACE)
def test_no_model_besides_the_base_is_the_base(method):
    base = torch.randn(6, 4)
    assert torch.equal(_merge(method, [base]), base)


def test_more_tasks_than_the_rank_keep_one_direction_each():
    tensors = _family((3, 2), tasks=4)
    out = _merge("tsv", tensors)
    assert torch.isfinite(out).all() and out.shape == (3, 2)
    out = _merge("iso_cts", tensors, common_fraction=0.0)  # the common subspace keeps one direction
    assert torch.isfinite(out).all()


# --- registry -----------------------------------------------------------------------------------------------------


def test_registered_as_alloy_only_task_arithmetic_variants_with_defaults_and_ranges():
    assert ALLOY_ONLY_METHODS == set(SUBSPACE) and ALLOY_ONLY_METHODS <= set(METHODS)
    for name in SUBSPACE:
        spec = get_method(name)
        assert spec.family == "task_arithmetic" and spec.requires_base and not spec.random
        assert spec.reference.startswith("https://arxiv.org/")
        assert spec.param("alpha").name == "lambda" and spec.param("lambda").default == 1.0
    assert get_method("tsv").param("rank_fraction").default == 1.0
    assert get_method("iso_cts").param("common_fraction").default == 0.8
    with pytest.raises(ValueError):
        get_method("iso_cts").param("common_fraction").check(1.5)


@pytest.mark.parametrize("method", SUBSPACE)
def test_same_bits_whatever_the_thread_count_on_matrices(method):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 200, generator=g)
    tensors = [base] + [base + 0.05 * torch.randn(300, 200, generator=g) for _ in range(3)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_merge(method, tensors))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)
