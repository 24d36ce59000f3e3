"""The merge methods and the parameters each declares; validation and per-tensor resolution of parameter values.

``METHODS`` holds mergekit 0.1.5's methods under their mergekit names, with mergekit's parameter names, defaults
and scopes (checked against its source; ranges are ours where mergekit has none but values outside are
meaningless, e.g. density in [0, 1]). Deviations, all documented at the kernel: exact top-k keeps ties by position
(mergekit's fp32 argsort is unstable there); random methods draw from the per-tensor generator in a fixed order
(parity with mergekit is statistical); arcee_fusion's quartiles are exact (mergekit samples above 10^6 entries);
DELLA gives a one-entry row probability ``density`` (mergekit fails); linear and multislerp refuse to normalize
weights summing to zero (mergekit divides by zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kernels import (
    arcee_fusion,
    gta,
    iso,
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
    tsv,
)
from kernels.errors import InvalidParameterError, UnknownStrategyError
from kernels.params import is_filter_list, is_gradient, is_scalar, scalar_points

# "global": one value per tensor (mergekit's SHARED scope); "per_model": one value per model other than the base
# (mergekit's NON_BASE); "input": one value per
# input model, the base included (mergekit's INPUT: linear's weight, passthrough's scale).
Scope = Literal["global", "per_model", "input"]
Kernel = Callable[..., Any]  # (tensors, base_index, global_params, model_params, generator, owned) -> float32 tensor


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: type  # float, int or bool
    default: float | int | bool | None  # None: no value (a required parameter, or passthrough's optional scale)
    scope: Scope
    minimum: float | None = None
    maximum: float | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""
    required: bool = False  # mergekit refuses a merge that leaves it unset (for a non-base model, if per model)

    def check(self, value: Any) -> None:
        """Raise InvalidParameterError unless ``value`` is a legal scalar, gradient or filter list for this spec."""
        if self.type is int:
            if not (isinstance(value, int) and not isinstance(value, bool)):
                raise InvalidParameterError(self.name, f"expected a whole number, got {value!r}")
            self._check_range(float(value))
        elif self.type is bool:
            legal_form = isinstance(value, bool) or (
                is_filter_list(value) and all(isinstance(e["value"], bool) for e in value)
            )
            if not legal_form:
                raise InvalidParameterError(self.name, f"expected true/false (or a filter list of them), got {value!r}")
        else:
            if not (is_scalar(value) or is_gradient(value) or is_filter_list(value)):
                raise InvalidParameterError(
                    self.name, f"expected a number, a gradient list of numbers or a filter list, got {value!r}"
                )
            if is_filter_list(value):
                for entry in value:
                    if not (entry.get("filter") is None or isinstance(entry["filter"], str)):
                        raise InvalidParameterError(self.name, f"filter must be a string, got {entry['filter']!r}")
                    if not (
                        (is_scalar(entry["value"]) and not isinstance(entry["value"], bool))
                        or is_gradient(entry["value"])
                    ):
                        raise InvalidParameterError(
                            self.name, f"filter value must be a number or gradient, got {entry['value']!r}"
                        )
            for point in scalar_points(value):
                if isinstance(point, bool):
                    raise InvalidParameterError(self.name, f"expected a number, got {point!r}")
                self._check_range(float(point))

    def _check_range(self, number: float) -> None:
        if not math.isfinite(number):
            raise InvalidParameterError(self.name, f"must be finite, got {number}")
        if self.minimum is not None and number < self.minimum:
            raise InvalidParameterError(self.name, f"must be >= {self.minimum}, got {number}")
        if self.maximum is not None and number > self.maximum:
            raise InvalidParameterError(self.name, f"must be <= {self.maximum}, got {number}")


# --- mergekit 0.1.5 methods ----------------------------------------------------------------------------------

Family = Literal["slerp", "ties", "dare", "task_arithmetic", "franken_merge"]  # the HTTP strategies
BasePolicy = Literal["required", "optional", "ignored"]


@dataclass(frozen=True)
class MethodSpec:
    """A mergekit merge method: its parameters (names, defaults and scopes as mergekit 0.1.5 declares them), its
    kernel, and the inputs it takes. ``min_models``/``max_models`` count every input, the base included;
    ``min_non_base``/``max_non_base`` count the others. ``uses_base``: the kernel reads a base when there is one;
    ``requires_base``: it needs one. ``family``: the HTTP strategy it is a variant of."""

    name: str
    description: str
    params: tuple[ParamSpec, ...]
    kernel: Kernel
    min_models: int = 2
    max_models: int = 8
    uses_base: bool = True
    random: bool = False  # draws from the per-tensor generator
    family: Family = "task_arithmetic"
    base: BasePolicy = "required"
    min_non_base: int | None = None
    max_non_base: int | None = None
    reference: str = ""
    param_index: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        index = {}
        for spec in self.params:
            for key in (spec.name, *spec.aliases):
                index[key] = spec
        object.__setattr__(self, "param_index", index)

    def param(self, name: str) -> ParamSpec:
        """The parameter under its name or an alias; InvalidParameterError naming it when the method has none."""
        spec = self.param_index.get(name)
        if spec is None:
            known = ", ".join(p.name for p in self.params) or "none"
            raise InvalidParameterError(name, f"unknown parameter for {self.name} (known: {known})")
        return spec

    @property
    def requires_base(self) -> bool:
        return self.base == "required"

    def check_inputs(self, count: int, has_base: bool) -> None:
        """Raise InvalidParameterError (parameter ``models``) unless this many inputs, with or without a base, are
        what the method takes (mergekit's input contract; a base is not counted as such when ignored)."""
        if self.base == "required" and not has_base:
            raise InvalidParameterError("base_model", f"{self.name} needs a base model")
        has_base = has_base and self.base != "ignored"
        _check_count(self.name, "models", count, self.min_models, self.max_models)
        if self.min_non_base is not None or self.max_non_base is not None:
            _check_count(
                self.name, "models besides the base", count - int(has_base), self.min_non_base or 0, self.max_non_base
            )


def _check_count(method: str, what: str, count: int, minimum: int, maximum: int | None) -> None:
    if count < minimum or (maximum is not None and count > maximum):
        wanted = (
            f"exactly {minimum}"
            if minimum == maximum
            else f"at least {minimum}"
            if maximum is None
            else f"{minimum} to {maximum}"
        )
        raise InvalidParameterError("models", f"{method} takes {wanted} {what}, got {count}")


UNLIMITED = 1 << 30  # mergekit sets no upper bound; the service caps the model count itself


def _p(
    name: str,
    type_: type,
    default: Any,
    scope: Scope = "global",
    minimum: float | None = None,
    maximum: float | None = None,
    description: str = "",
    required: bool = False,
) -> ParamSpec:
    return ParamSpec(name, type_, default, scope, minimum, maximum, description=description, required=required)


def _required_weight(scope: Scope = "per_model") -> ParamSpec:
    return _p("weight", float, None, scope, description="the model's weight (required)", required=True)


def _gta_params(sparsifier: str | None, normalize: bool, rescale: bool) -> tuple[ParamSpec, ...]:
    params = [
        _p("int8_mask", bool, False, description="mergekit stores its sign mask as int8 (memory only): no effect here"),
        _p(
            "normalize",
            bool,
            normalize,
            description="divide the combined task vector by the sum of the weights "
            "(of the models that agree with the elected sign, with consensus)",
        ),
        _p(
            "rescale",
            bool,
            rescale,
            description="after pruning, scale the task vector back to its L1 norm"
            + ("" if sparsifier else " (no pruning here: no effect)"),
        ),
        _p("lambda", float, 1.0, description="scale of the merged task vector"),
        _required_weight(),
        _p(
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
            _p(
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
            _p(
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
        (_required_weight("input"), _p("normalize", bool, True, description="divide by the sum of weights")),
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
        (_p("t", float, None, "global", 0.0, 1.0, "interpolation factor (required)", required=True),),
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
            _required_weight(),
            _p(
                "nuslerp_row_wise",
                bool,
                False,
                description="interpolate columns (slices along dim 0) instead of rows, when not flattened",
            ),
            _p("nuslerp_flatten", bool, True, description="interpolate the whole tensor as one vector"),
        ),
        nuslerp.merge,
        min_models=2,
        max_models=3,
        family="slerp",
        base="optional",
        min_non_base=2,
        max_non_base=2,
    ),
    MethodSpec(
        "multislerp",
        "barycentric spherical interpolation of any number of models (of their task vectors with a base)",
        (
            _required_weight(),
            _p("normalize_weights", bool, True, description="divide the weights by their sum"),
            _p("eps", float, 1e-8, "global", 0.0, description="numerical floor of norms"),
        ),
        multislerp.merge,
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
            _p("max_iter", int, 10, "global", 0, 10_000, "iterations of the fixed-point search"),
            _p("tol", float, 1e-5, "global", 0.0, description="convergence tolerance"),
        ),
        karcher.merge,
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
        (_p("filter_wise", bool, False, description="one interpolation factor per row instead of per tensor"),),
        model_stock.merge,
        min_models=3,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2403.19522",
    ),
    MethodSpec(
        "nearswap",
        "take the other model's entries where they are within t of the base's",
        (_p("t", float, None, "global", 0.0, description="distance threshold (required)", required=True),),
        nearswap.merge,
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
        min_models=2,
        max_models=2,
        family="task_arithmetic",
        reference="https://arcee.ai",
    ),
    MethodSpec(
        "sce",
        "select high-variance entries, weight models by energy, erase minority signs",
        (
            _p("int8_mask", bool, False, description="mergekit stores its masks as int8 (memory only): no effect here"),
            _p(
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
        min_models=1,
        max_models=UNLIMITED,
        family="ties",
        reference="https://arxiv.org/abs/2408.07990",
    ),
    MethodSpec(
        "ram",
        "entries changed by one model keep its change, by several the mean of theirs",
        (_p("epsilon", float, 1e-5, "global", 0.0, description="smallest change that counts"),),
        ram.merge_ram,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2601.13572",
    ),
    MethodSpec(
        "ramplus_tl",
        "RAM with each model's unique changes scaled up by its shared/unique ratio",
        (
            _p("r", float, 0.1, "global", description="strength of the unique-change scaling"),
            _p("alpha", float, 0.2, "global", description="cap of the shared/unique ratio"),
            _p("epsilon", float, 1e-5, "global", 0.0, description="smallest change that counts"),
        ),
        ram.merge_ramplus_tl,
        min_models=1,
        max_models=UNLIMITED,
        family="task_arithmetic",
        reference="https://arxiv.org/abs/2601.13572",
    ),
    MethodSpec(
        "passthrough",
        "one model's tensor, times its optional scale (layer stacking is planned elsewhere)",
        (_p("scale", float, None, "input", description="multiplier of the tensor (none: unchanged)"),),
        passthrough.merge,
        min_models=1,
        max_models=1,
        uses_base=False,
        family="franken_merge",
        base="ignored",
    ),
)


# --- Alloy-only methods (not in mergekit: no mergekit YAML can name them) -----------------------------------------


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
        _p(
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


_ALLOY_METHODS = (
    MethodSpec(
        "tsv",
        "TSV-M: each task matrix's top singular vectors, concatenated and whitened (orthogonalised); "
        "other tensors: mean task vector",
        _subspace_params(
            _p(
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
        reference="https://arxiv.org/abs/2502.04959",
    ),
    MethodSpec(
        "iso_cts",
        "Iso-CTS: common subspace of the summed task matrix plus each task's own directions, "
        "orthogonalised, flat spectrum; other tensors: mean task vector",
        _subspace_params(
            _p(
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
        reference="https://arxiv.org/abs/2502.04959",
    ),
)
ALLOY_ONLY_METHODS = frozenset(spec.name for spec in _ALLOY_METHODS)  # mergekit has no such method

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (*_OTHER_METHODS, *_GTA_METHODS, *_ALLOY_METHODS)}


def get_method(name: str) -> MethodSpec:
    spec = METHODS.get(name)
    if spec is None:
        raise UnknownStrategyError(name, sorted(METHODS))
    return spec


def check_required(
    spec: MethodSpec,
    global_params: Mapping[str, Any],
    model_params: Sequence[Mapping[str, Any]],
    base_index: int | None,
) -> None:
    """Raise InvalidParameterError for a required parameter left unset (canonical names expected): a global one
    anywhere, a per-model one for any model but the base (mergekit binds those to the other models only), an
    input one for any model. A value given globally counts for every model."""
    for param in spec.params:
        if not param.required or param.name in global_params:
            continue
        if param.scope == "global":
            raise InvalidParameterError(param.name, f"is required by {spec.name}")
        for index, params in enumerate(model_params):
            skip_base = param.scope == "per_model" and index == base_index
            if not skip_base and param.name not in params:
                raise InvalidParameterError(
                    param.name, f"is required by {spec.name} for every model (missing for model {index})"
                )
