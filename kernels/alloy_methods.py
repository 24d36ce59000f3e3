"""Alloy-only merge methods: data-free operators published after mergekit 0.1.5 (no mergekit YAML can name them)."""

from __future__ import annotations

from kernels import iso, tsv
from kernels.specs import UNLIMITED, MethodSpec, ParamSpec, param


def _subspace_params(*extra: ParamSpec) -> tuple[ParamSpec, ...]:
    return (
        ParamSpec(
            "lambda",
            float,
            1.0,
            "global",
            -100.0,
            100.0,
            aliases=("alpha",),
            description="scale of the merged task vector (the papers' alpha)",
        ),
        param(
            "weight",
            float,
            1.0,
            "per_model",
            -100.0,
            100.0,
            description="multiplier of the model's task vector before the decomposition",
        ),
        *extra,
    )


ALLOY_METHODS = (
    MethodSpec(
        "tsv",
        "TSV-M: each task matrix's top singular vectors, concatenated and whitened (orthogonalised); "
        "other tensors: mean task vector",
        _subspace_params(
            param(
                "rank_fraction",
                float,
                1.0,
                "global",
                0.0,
                1.0,
                description="share of min(m, n) the tasks' kept ranks add up to "
                "(k = rank_fraction * min(m, n) / T per task, at least 1)",
            )
        ),
        tsv.merge,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        threaded_kernel=True,
        reference="https://arxiv.org/abs/2412.00081",
    ),
    MethodSpec(
        "iso_c",
        "Iso-C: the summed task matrix with a flat spectrum (mean singular value); other tensors: mean task vector",
        _subspace_params(),
        iso.merge_iso_c,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        threaded_kernel=True,
        reference="https://arxiv.org/abs/2502.04959",
    ),
    MethodSpec(
        "iso_cts",
        "Iso-CTS: common subspace of the summed task matrix plus each task's own directions, "
        "orthogonalised, flat spectrum; other tensors: mean task vector",
        _subspace_params(
            param(
                "common_fraction",
                float,
                0.8,
                "global",
                0.0,
                1.0,
                description="share of min(m, n) given to the common subspace",
            )
        ),
        iso.merge_iso_cts,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        threaded_kernel=True,
        reference="https://arxiv.org/abs/2502.04959",
    ),
)
ALLOY_ONLY_METHODS = frozenset(spec.name for spec in ALLOY_METHODS)  # mergekit has no such method
