"""Differential test: every method's kernel against mergekit 0.1.5's own per-tensor merge on the same random tensors.

mergekit runs in its own interpreter (``ALLOY_MERGEKIT_PYTHON``, else ``/work/mkvenv/bin/python``), never in the
project's: inputs go to it as safetensors in a temporary folder, a small script merges each case with
``mergekit.merge_methods.merge_tensors`` and writes the outputs back. Skipped when no such interpreter exists.

Deterministic methods must agree to 1e-6 (float32). Random methods cannot agree bit for bit (mergekit draws from
torch's global generator, we from a per-tensor one), so on large tensors the kept fraction and the L1 norm of the
merged change must agree within 0.5%.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.registry import ALLOY_ONLY_METHODS, METHODS, get_method

MERGEKIT_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    from mergekit.merge_methods import merge_tensors

    folder = sys.argv[1]
    cases = json.load(open(f"{folder}/cases.json"))
    inputs = load_file(f"{folder}/inputs.safetensors")
    outputs = {}
    for index, case in enumerate(cases):
        torch.manual_seed(index)
        params = dict(case["shared"])
        for name, values in case["per_input"].items():
            params[name] = {i: v for i, v in enumerate(values) if v is not None}
        tensors = [inputs[key] for key in case["tensors"]]
        outputs[case["id"]] = merge_tensors(tensors, case["method"], parameters=params,
                                            base_index=case["base_index"]).contiguous()
    save_file(outputs, f"{folder}/outputs.safetensors")
""")

DETERMINISTIC_ATOL = 1e-6
RANDOM_RTOL = 0.005


def mergekit_python() -> str | None:
    candidate = os.environ.get("ALLOY_MERGEKIT_PYTHON") or "/work/mkvenv/bin/python"
    if not Path(candidate).exists():
        return None
    probe = subprocess.run([candidate, "-c", "import mergekit.merge_methods"], capture_output=True, timeout=120)
    return candidate if probe.returncode == 0 else None


PYTHON = mergekit_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason="no python with mergekit (set ALLOY_MERGEKIT_PYTHON)")


def _family(seed: int, shape: tuple[int, ...], count: int, spread: float = 0.1) -> list[torch.Tensor]:
    """A base and ``count - 1`` fine-tunes of it: what merges see in practice."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return [base] + [base + spread * torch.randn(shape, generator=g) for _ in range(count - 1)]


def _sparse_changes(seed: int, shape: tuple[int, ...], count: int) -> list[torch.Tensor]:
    """For RAM: each fine-tune changes only about a third of the entries, so unique and shared changes occur."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    out = [base]
    for _ in range(count - 1):
        change = 0.1 * torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.35)
        out.append(base + change)
    return out


# (id, method, tensors, base_index, shared parameters, per-input parameters by input position (None: the base))
def _cases() -> list[tuple]:
    three = _family(1, (32, 24), 3)
    four = _family(2, (16, 40), 4)
    vector = _family(3, (200,), 3)
    ram_in = _sparse_changes(4, (30, 30), 4)
    w3 = [None, 0.6, 0.4]
    w4 = [None, 0.5, 0.3, 0.2]
    cases = [
        ("linear", "linear", three, None, {}, {"weight": [0.2, 0.5, 0.3]}),
        ("linear_raw", "linear", three, None, {"normalize": False}, {"weight": [0.2, 0.5, 0.3]}),
        ("slerp", "slerp", three[:2], 0, {"t": 0.3}, {}),
        ("slerp_base_second", "slerp", three[:2], 1, {"t": 0.7}, {}),
        ("nuslerp_base", "nuslerp", three, 0, {}, {"weight": w3}),
        ("nuslerp_rows", "nuslerp", three, 0, {"nuslerp_flatten": False}, {"weight": w3}),
        ("nuslerp_cols", "nuslerp", three, 0, {"nuslerp_flatten": False, "nuslerp_row_wise": True}, {"weight": w3}),
        ("nuslerp_nobase", "nuslerp", three[1:], None, {}, {"weight": [0.3, 0.7]}),
        ("multislerp_base", "multislerp", four, 0, {}, {"weight": w4}),
        ("multislerp_nobase", "multislerp", four[1:], None, {}, {"weight": [0.5, 0.3, 0.2]}),
        ("karcher", "karcher", four, None, {}, {}),
        ("karcher_iter", "karcher", three, None, {"max_iter": 3, "tol": 1e-6}, {}),
        ("model_stock", "model_stock", four, 0, {}, {}),
        ("model_stock_rows", "model_stock", four, 0, {"filter_wise": True}, {}),
        ("model_stock_vector", "model_stock", vector, 0, {"filter_wise": True}, {}),
        ("nearswap", "nearswap", three[:2], 0, {"t": 0.08}, {}),
        ("arcee_fusion", "arcee_fusion", three[:2], 0, {}, {}),
        ("sce", "sce", four, 0, {}, {}),
        ("sce_topk", "sce", four, 0, {"select_topk": 0.3}, {}),
        ("ram", "ram", ram_in, 0, {}, {}),
        ("ramplus_tl", "ramplus_tl", ram_in, 0, {"r": 0.5, "alpha": 0.4}, {}),
        ("passthrough", "passthrough", three[:1], None, {}, {"scale": [1.5]}),
        ("passthrough_plain", "passthrough", three[:1], None, {}, {}),
        ("task_arithmetic", "task_arithmetic", four, 0, {"lambda": 0.8}, {"weight": w4}),
        ("task_arithmetic_norm", "task_arithmetic", four, 0, {"normalize": True}, {"weight": w4}),
        ("ties", "ties", four, 0, {}, {"weight": w4, "density": [None, 0.5, 0.3, 0.7]}),
        (
            "ties_rescale",
            "ties",
            four,
            0,
            {"rescale": True, "lambda": 1.2},
            {"weight": w4, "density": [None, 0.5, 0.3, 0.7]},
        ),
        ("ties_vector", "ties", vector, 0, {}, {"weight": w3, "density": [None, 0.4, 0.6]}),
        (
            "breadcrumbs",
            "breadcrumbs",
            four,
            0,
            {},
            {"weight": w4, "density": [None, 0.5, 0.3, 0.7], "gamma": [None, 0.05, 0.1, 0.01]},
        ),
        (
            "breadcrumbs_ties",
            "breadcrumbs_ties",
            four,
            0,
            {"rescale": True, "normalize": True},
            {"weight": w4, "density": [None, 0.5, 0.8, 0.7], "gamma": [None, 0.05, 0.3, 0.01]},
        ),
    ]
    return cases + _edge_cases()


def _edge_cases() -> list[tuple]:
    """Degenerate inputs, where both implementations take their special branches."""
    x = _family(7, (12, 10), 2)[1]
    same = [x, x.clone(), x.clone()]
    return [
        ("slerp_parallel", "slerp", [x, 2 * x], 0, {"t": 0.25}, {}),
        ("slerp_antiparallel", "slerp", [x, -3 * x], 0, {"t": 0.5}, {}),
        ("nuslerp_antiparallel", "nuslerp", [x, -x], None, {}, {"weight": [1.0, 3.0]}),
        ("multislerp_antipodal", "multislerp", [x, -x], None, {}, {"weight": [0.5, 0.5]}),
        ("multislerp_single", "multislerp", [x, 2 * x], 0, {}, {"weight": [None, 0.5]}),
        ("karcher_identical", "karcher", same, None, {}, {}),
        ("karcher_zero", "karcher", [torch.zeros(5), torch.zeros(5)], None, {}, {}),
        ("model_stock_identical", "model_stock", same, 0, {}, {}),
        ("sce_identical", "sce", same, 0, {"select_topk": 0.5}, {}),
        ("ties_zero_task_vectors", "ties", same, 0, {}, {"weight": [None, 1.0, 1.0], "density": [None, 0.5, 0.5]}),
        (
            "ties_density_zero_one",
            "ties",
            _family(8, (6, 7), 3),
            0,
            {"rescale": True},
            {"weight": [None, 1.0, 0.5], "density": [None, 0.0, 1.0]},
        ),
        (
            "breadcrumbs_density_zero",
            "breadcrumbs",
            _family(8, (6, 7), 3),
            0,
            {"rescale": True},
            {"weight": [None, 1.0, 0.5], "density": [None, 0.0, 0.9], "gamma": [None, 0.1, 0.2]},
        ),
        (
            "task_arithmetic_weights_cancel",
            "task_arithmetic",
            _family(9, (5, 4), 3),
            0,
            {"normalize": True},
            {"weight": [None, 1.0, -1.0]},
        ),
        ("linear_single", "linear", [x], None, {}, {"weight": [2.0]}),
        ("nearswap_identical", "nearswap", [x, x.clone()], 0, {"t": 0.1}, {}),
    ]


def _random_cases() -> list[tuple]:
    one = _family(5, (1024, 1024), 2)
    two = _family(6, (1024, 1024), 3)
    return [
        ("dare_linear", "dare_linear", one, 0, {"rescale": False}, {"weight": [None, 1.0], "density": [None, 0.3]}),
        ("dare_linear_rescaled", "dare_linear", one, 0, {}, {"weight": [None, 1.0], "density": [None, 0.3]}),
        (
            "dare_ties",
            "dare_ties",
            two,
            0,
            {"rescale": False},
            {"weight": [None, 0.6, 0.4], "density": [None, 0.5, 0.7]},
        ),
        (
            "della_linear",
            "della_linear",
            one,
            0,
            {"rescale": False},
            {"weight": [None, 1.0], "density": [None, 0.4], "epsilon": [None, 0.2]},
        ),
        (
            "della",
            "della",
            two,
            0,
            {"rescale": False},
            {"weight": [None, 0.6, 0.4], "density": [None, 0.5, 0.3], "epsilon": [None, 0.1, 0.25]},
        ),
        (
            "della_rescaled",
            "della",
            two,
            0,
            {},
            {"weight": [None, 0.6, 0.4], "density": [None, 0.5, 0.3], "epsilon": [None, 0.1, 0.25]},
        ),
    ]


def _ours(method: str, tensors, base_index, shared, per_input) -> torch.Tensor:
    spec = get_method(method)
    global_params = {p.name: shared.get(p.name, p.default) for p in spec.params if p.scope == "global"}
    model_params = []
    for position in range(len(tensors)):
        mine = {}
        for p in spec.params:
            if p.scope == "global":
                continue
            values = per_input.get(p.name)
            value = values[position] if values is not None else None
            mine[p.name] = p.default if value is None else value
        model_params.append(mine)
    generator = torch.Generator().manual_seed(1234)
    return spec.kernel([t.clone() for t in tensors], base_index, global_params, model_params, generator)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple]]:
    """Case id -> (ours, mergekit's, case); mergekit runs once for every case."""
    folder = tmp_path_factory.mktemp("mergekit")
    cases = _cases() + _random_cases()
    inputs, described = {}, []
    for case_id, method, tensors, base_index, shared, per_input in cases:
        keys = [f"{case_id}.{i}" for i in range(len(tensors))]
        inputs.update({k: t.clone() for k, t in zip(keys, tensors)})
        described.append(
            {
                "id": case_id,
                "method": method,
                "tensors": keys,
                "base_index": base_index,
                "shared": shared,
                "per_input": per_input,
            }
        )
    save_file(inputs, folder / "inputs.safetensors")
    (folder / "cases.json").write_text(json.dumps(described))
    (folder / "run.py").write_text(MERGEKIT_SCRIPT)
    run = subprocess.run([PYTHON, str(folder / "run.py"), str(folder)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = load_file(folder / "outputs.safetensors")
    return {case[0]: (_ours(*case[1:]), theirs[case[0]], case) for case in cases}


@pytest.mark.parametrize("case_id", [case[0] for case in _cases()])
def test_deterministic_method_matches_mergekit(merged, case_id):
    ours, theirs, _ = merged[case_id]
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert (ours - theirs.float()).abs().max().item() <= DETERMINISTIC_ATOL


@pytest.mark.parametrize("case_id", [case[0] for case in _random_cases()])
def test_random_method_matches_mergekit_statistically(merged, case_id):
    ours, theirs, case = merged[case_id]
    base = case[2][case[3]]
    ours_change, theirs_change = ours - base, theirs.float() - base
    kept_ours = (ours_change != 0).float().mean().item()
    kept_theirs = (theirs_change != 0).float().mean().item()
    assert kept_ours == pytest.approx(kept_theirs, rel=RANDOM_RTOL)
    l1_ours, l1_theirs = ours_change.abs().double().sum().item(), theirs_change.abs().double().sum().item()
    assert l1_ours == pytest.approx(l1_theirs, rel=RANDOM_RTOL)


def test_every_method_is_covered():
    covered = {case[1] for case in _cases() + _random_cases()}
    assert covered == set(METHODS) - ALLOY_ONLY_METHODS  # mergekit has no TSV-M / Iso-C to compare with
