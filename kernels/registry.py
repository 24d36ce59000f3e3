"""The merge methods and the parameters each declares; validation and per-tensor resolution of parameter values.

``METHODS`` holds mergekit 0.1.5's methods under their mergekit names, with mergekit's parameter names, defaults
and scopes (checked against its source; ranges are ours where mergekit has none but values outside are
meaningless, e.g. density in [0, 1]). Deviations, all documented at the kernel: exact top-k keeps ties by position
(mergekit's fp32 argsort is unstable there); random methods draw from the per-tensor generator in a fixed order
(parity with mergekit is statistical); arcee_fusion's quartiles are exact (mergekit samples above 10^6 entries);
DELLA gives a one-entry row probability ``density`` (mergekit fails); linear and multislerp refuse to normalize
weights summing to zero (mergekit divides by zero).
"""

from kernels import (
    arcee_fusion,
    gta,
    karcher,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    sce,
    slerp,
)
from kernels.alloy_methods import ALLOY_METHODS, ALLOY_ONLY_METHODS
from kernels.errors import UnknownStrategyError
from kernels.specs import UNLIMITED, Family, MethodSpec, ParamSpec, param, required_weight

__all__ = ["ALLOY_ONLY_METHODS", "METHODS", "get_method"]


def _gta_params(sparsifier: str | None, normalize: bool, rescale: bool) -> tuple[ParamSpec, ...]:
    params = [
        param(
            "int8_mask", bool, False, description="mergekit stores its sign mask as int8 (memory only): no effect here"
        ),
        param(
            "normalize",
            bool,
            normalize,
            description="divide the combined task vector by the sum of the weights "
            "(of the models that agree with the elected sign, with consensus)",
        ),
        param(
            "rescale",
            bool,
            rescale,
            description="after pruning, scale the task vector back to its L1 norm"
            + ("" if sparsifier else " (no pruning here: no effect)"),
        ),
        param("lambda", float, 1.0, description="scale of the merged task vector"),
        required_weight(),
        param(
            "density",
            float,
            1.0,
            "per_model",
            0.0,
            1.0,
            description="fraction of the task vector kept" + ("" if sparsifier else " (no pruning here: no effect)"),
        ),
    ]
    if sparsifier == "magnitude_outliers":
        params.append(
            param(
                "gamma",
                float,
                0.01,
                "per_model",
                0.0,
                1.0,
                description="fraction of the largest-magnitude entries dropped before keeping density",
            )
        )
    if sparsifier == "della_magprune":
        params.append(
            param(
                "epsilon",
                float,
                0.15,
                "per_model",
                0.0,
                0.5,
                description="keep probabilities spread over density ± epsilon by magnitude rank; "
                "density ± epsilon must lie strictly inside (0, 1)",
            )
        )
    return tuple(params)


def _gta(
    name: str,
    family: Family,
    description: str,
    sparsifier: str | None,
    consensus: bool,
    normalize: bool,
    rescale: bool,
    reference: str,
) -> MethodSpec:
    return MethodSpec(
        name,
        description,
        _gta_params(sparsifier, normalize, rescale),
        gta.kernel(sparsifier, consensus),
        min_models=1,
        max_models=UNLIMITED,
        random=sparsifier in ("random", "della_magprune"),
        family=family,
        reference=reference,
        computes_in_dtype=True,
    )


_GTA_METHODS = (
    _gta(
        "task_arithmetic",
        "task_arithmetic",
        "base + lambda * sum(w_i * (x_i - base))",
        None,
        False,
        False,
        False,
        "https://arxiv.org/abs/2212.04089",
    ),
    _gta(
        "ties",
        "ties",
        "trim task vectors to the top density by magnitude, elect signs, disjoint weighted mean",
        "magnitude",
        True,
        True,
        False,
        "https://arxiv.org/abs/2306.01708",
    ),
    _gta(
        "dare_ties",
        "dare",
        "drop task-vector entries at random (keep density), rescale, TIES sign consensus",
        "random",
        True,
        False,
        True,
        "https://arxiv.org/abs/2311.03099",
    ),
    _gta(
        "dare_linear",
        "dare",
        "drop task-vector entries at random (keep density), rescale, weighted sum",
        "random",
        False,
        False,
        True,
        "https://arxiv.org/abs/2311.03099",
    ),
    _gta(
        "breadcrumbs",
        "ties",
        "drop the largest (gamma) and smallest task-vector entries, weighted sum",
        "magnitude_outliers",
        False,
        False,
        False,
        "https://arxiv.org/abs/2312.06795",
    ),
    _gta(
        "breadcrumbs_ties",
        "ties",
        "breadcrumbs pruning with TIES sign consensus",
        "magnitude_outliers",
        True,
        False,
        False,
        "https://arxiv.org/abs/2312.06795",
    ),
    _gta(
        "della",
        "ties",
        "magnitude-ranked random pruning (MagPrune), rescale, TIES sign consensus",
        "della_magprune",
        True,
        True,
        True,
        "https://arxiv.org/abs/2406.11617",
    ),
    _gta(
        "della_linear",
        "ties",
        "magnitude-ranked random pruning (MagPrune), rescale, weighted sum",
        "della_magprune",
        False,
        False,
        True,
        "https://arxiv.org/abs/2406.11617",
    ),
)

_OTHER_METHODS = (
    MethodSpec(
        "linear",
        "weighted average of all the models (a base is just another input)",
        (required_weight("input"), param("normalize", bool, True, description="divide by the sum of weights")),
        linear.merge,
        min_models=1,
        max_models=UNLIMITED,
        uses_base=False,
        family="task_arithmetic",
        base="ignored",
        reference="https://arxiv.org/abs/2203.05482",
    ),
    MethodSpec(
        "slerp",
        "spherical interpolation of the base (t = 0) and one other model (t = 1)",
        (param("t", float, None, "global", 0.0, 1.0, "interpolation factor (required)", required=True),),
        slerp.merge,
        min_models=2,
        max_models=2,
        family="slerp",
        reference="https://en.wikipedia.org/wiki/Slerp",
    ),
    MethodSpec(
        "nuslerp",
        "spherical interpolation of two models (of their task vectors with a base), t from "
        "their weights, whole tensor or row by row",
        (
            required_weight(),
            param(
                "nuslerp_row_wise",
                bool,
                False,
                description="interpolate columns (slices along dim 0) instead of rows, when not flattened",
            ),
            param("nuslerp_flatten", bool, True, description="interpolate the whole tensor as one vector"),
        ),
        nuslerp.merge,
        min_models=2,
        max_models=3,
        family="slerp",
        base="optional",
        min_non_base=2,
        max_non_base=2,
        computes_in_dtype=True,
    ),
    MethodSpec(
        "multislerp",
        "barycentric spherical interpolation of any number of models (of their task vectors with a base)",
        (
            required_weight(),
            param("normalize_weights", bool, True, description="divide the weights by their sum"),
            param("eps", float, 1e-8, "global", 0.0, description="numerical floor of norms"),
        ),
        multislerp.merge,
        computes_in_dtype=True,
        min_models=1,
        max_models=UNLIMITED,
        family="slerp",
        base="optional",
        min_non_base=1,
        reference="https://goddard.blog/posts/multislerp-wow-what-a-cool-idea",
    ),
    MethodSpec(
        "karcher",
        "Riemannian (Karcher) mean of all the models' directions, scaled by their mean norm",
        (
            param("max_iter", int, 10, "global", 0, 10_000, "iterations of the fixed-point search"),
            param("tol", float, 1e-5, "global", 0.0, description="convergence tolerance"),
        ),
        karcher.merge,
        computes_in_dtype=True,
        min_models=1,
        max_models=UNLIMITED,
        uses_base=False,
        family="slerp",
        base="ignored",
        reference="https://arxiv.org/abs/2603.04972",
    ),
    MethodSpec(
        "model_stock",
        "interpolate base and mean of the models by the angle between their task vectors",
        (param("filter_wise", bool, False, description="one interpolation factor per row instead of per tensor"),),
        model_stock.merge,
        computes_in_dtype=True,
        min_models=3,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2403.19522",
    ),
    MethodSpec(
        "nearswap",
        "take the other model's entries where they are within t of the base's",
        (param("t", float, None, "global", 0.0, description="distance threshold (required)", required=True),),
        nearswap.merge,
        computes_in_dtype=True,
        min_models=2,
        max_models=2,
        family="task_arithmetic",
        reference="https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001",
    ),
    MethodSpec(
        "arcee_fusion",
        "take the other model's entries where the change is important (KL-weighted)",
        (),
        arcee_fusion.merge,
        computes_in_dtype=True,
        float32_result=True,
        min_models=2,
        max_models=2,
        family="task_arithmetic",
        reference="https://arcee.ai",
    ),
    MethodSpec(
        "sce",
        "select high-variance entries, weight models by energy, erase minority signs",
        (
            param(
                "int8_mask", bool, False, description="mergekit stores its masks as int8 (memory only): no effect here"
            ),
            param(
                "select_topk",
                float,
                1.0,
                "global",
                0.0,
                1.0,
                description="fraction of the entries (by variance across models) kept",
            ),
        ),
        sce.merge,
        computes_in_dtype=True,
        min_models=1,
        max_models=UNLIMITED,
        family="ties",
        reference="https://arxiv.org/abs/2408.07990",
    ),
    MethodSpec(
        "ram",
        "entries changed by one model keep its change, by several the mean of theirs",
        (param("epsilon", float, 1e-5, "global", 0.0, description="smallest change that counts"),),
        ram.merge_ram,
        computes_in_dtype=True,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2601.13572",
    ),
    MethodSpec(
        "ramplus_tl",
        "RAM with each model's unique changes scaled up by its shared/unique ratio",
        (
            param("r", float, 0.1, "global", description="strength of the unique-change scaling"),
            param("alpha", float, 0.2, "global", description="cap of the shared/unique ratio"),
            param("epsilon", float, 1e-5, "global", 0.0, description="smallest change that counts"),
        ),
        ram.merge_ramplus_tl,
        computes_in_dtype=True,
        float32_result=True,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2601.13572",
    ),
    MethodSpec(
        "passthrough",
        "one model's tensor, times its optional scale (layer stacking is planned elsewhere)",
        (param("scale", float, None, "input", description="multiplier of the tensor (none: unchanged)"),),
        passthrough.merge,
        min_models=1,
        max_models=1,
        uses_base=False,
        family="franken_merge",
        base="ignored",
    ),
)


METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (*_OTHER_METHODS, *_GTA_METHODS, *ALLOY_METHODS)}


def get_method(name: str) -> MethodSpec:
    spec = METHODS.get(name)
    if spec is None:
        raise UnknownStrategyError(name, sorted(METHODS))
    return spec
