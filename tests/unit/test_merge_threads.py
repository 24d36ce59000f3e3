"""``alloy merge``'s intra-op threads per merge thread: one, except for methods whose time is in LAPACK (SVDs)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from alloy.cli.merge import merge
from alloy.merge.methods import get_method
from alloy.merge.threads import intra_op_threads
from kernels.registry import METHODS


def test_only_the_svd_methods_share_the_cores_among_their_merge_threads():
    threaded = {name for name, spec in METHODS.items() if spec.threaded_kernel}
    assert threaded == {"tsv", "iso_c", "iso_cts"}
    for name in ("della", "ties", "breadcrumbs_ties", "sce", "dare_ties", "slerp", "task_arithmetic", "karcher"):
        assert intra_op_threads(get_method(name), cores=16, workers=2) == 1
    tsv = get_method("tsv")
    assert intra_op_threads(tsv, cores=16, workers=2) == 8
    assert intra_op_threads(tsv, cores=16, workers=3) == 5
    assert intra_op_threads(tsv, cores=2, workers=4) == 1  # never none
    assert intra_op_threads(tsv, cores=2, workers=0) == 2


@pytest.mark.parametrize(
    "method, options, expected",
    [("della", [], 1), ("tsv", [], 8), ("tsv", ["--workers", "4"], 4), ("della", ["--threads", "3"], 3)],
)
def test_the_cli_sets_the_methods_threads_unless_told(tiny_family, tmp_path, monkeypatch, method, options, expected):
    monkeypatch.setattr("alloy.merge.footprint.usable_cores", lambda: 16)
    base, tunes = tiny_family
    extra = "epsilon: 0.1, density: 0.5, " if method == "della" else ""
    recipe_file = tmp_path / "recipe.yml"
    recipe_file.write_text(f"""
merge_method: {method}
base_model: {base}
models:
  - model: {tunes[0]}
    parameters: {{{extra}weight: 0.5}}
  - model: {tunes[1]}
    parameters: {{{extra}weight: 0.5}}
""")
    before = torch.get_num_threads()
    try:
        outcome = CliRunner().invoke(merge, [str(recipe_file), str(tmp_path / "out"), "--quiet", *options])
        assert outcome.exit_code == 0, outcome.output
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
