"""The recipes of the mergekit differential bench and conformance tests: every configuration of mergekit 0.1.5's
``tests/test_basic_merges.py`` and every ``examples/*.yml`` (on pico models of the same form: the examples' 13B
models become a pico Llama, its LLaVA test models a pico Mistral3, LLaVA-style), plus the recipe forms Alloy
documents (several slices, partial depth, filters and gradients at every level, scale, LoRA inputs)."""

from __future__ import annotations

from bench.recipe_case import Case

BASIC = "test_basic_merges"
TWO = "models:\n  - model: {a}\n    parameters: {{weight: 0.6}}\n  - model: {b}\n    parameters: {{weight: 0.4}}\n"
WEIGHTS_IGNORED = ("models.0.parameters.weight", "models.1.parameters.weight")


def _two(method: str, base: str | None, params: str = "", models: str = TWO, dtype: str = "bfloat16") -> str:
    """mergekit's ``two_model_config``: two models weighted 0.6 / 0.4, bfloat16, optional base and parameters."""
    text = f"merge_method: {method}\n" + (f"base_model: {{{base}}}\n" if base else "") + models
    return text + (f"parameters: {{{{{params}}}}}\n" if params else "") + f"dtype: {dtype}\n"


def _basic(arch: str, prefix: str) -> tuple[Case, ...]:
    """The two-model configurations of ``TestBasicMerges`` (``prefix`` vlm- for their LLaVA variants)."""
    vlm = prefix == "vlm-"
    cases = [
        Case(f"{prefix}linear", arch, _two("linear", None), origin=BASIC),
        Case(f"{prefix}slerp", arch, _two("slerp", "a", "t: 0.35"), origin=BASIC, ignored=WEIGHTS_IGNORED),
        Case(f"{prefix}task-arithmetic", arch, _two("task_arithmetic", "base"), origin=BASIC),
        Case(f"{prefix}breadcrumbs", arch, _two("breadcrumbs", "base"), origin=BASIC),
        Case(
            f"{prefix}ties", arch, _two("ties", "base", "density: 0.3"), origin=BASIC, trimmed=("a", "b"), density=0.3
        ),
        Case(f"{prefix}model-stock", arch, _two("model_stock", "base"), origin=BASIC, ignored=WEIGHTS_IGNORED),
        Case(
            f"{prefix}model-stock-filterwise",
            arch,
            _two("model_stock", "base", "filter_wise: true"),
            origin=BASIC,
            ignored=WEIGHTS_IGNORED,
        ),
    ]
    for base in (None, "base"):
        for row_wise in ("false", "true"):
            for flatten in ("false", "true"):
                name = f"{prefix}nuslerp-{'base' if base else 'nobase'}-row{row_wise[0]}-flat{flatten[0]}"
                params = f"nuslerp_row_wise: {row_wise}, nuslerp_flatten: {flatten}"
                cases.append(Case(name, arch, _two("nuslerp", base, params), origin=BASIC))
    zero_sum = TWO.replace("0.6", "-0.5").replace("0.4", "0.5")
    params = "nuslerp_row_wise: false, nuslerp_flatten: false"
    cases.append(Case(f"{prefix}nuslerp-zero-sum", arch, _two("nuslerp", "base", params, zero_sum), origin=BASIC))
    # dare_ties draws at random: statistics on a wider model (the LLaVA variant keeps its own model)
    cases.append(
        Case(
            f"{prefix}dare-ties",
            arch if vlm else "llama-wide",
            _two("dare_ties", "base", "density: 0.66"),
            random=True,
            origin=BASIC,
        )
    )
    return tuple(cases)


def _granite() -> tuple[Case, ...]:
    return (
        Case(
            "granite-copy",
            "granite",
            "merge_method: passthrough\nmodels: [{{model: {a}}}]\ndtype: bfloat16\n",
            origin=BASIC,
        ),
        Case("granite-linear", "granite", _two("linear", None), origin=BASIC),
        Case(
            "granite-slerp",
            "granite",
            _two("slerp", "a", "t: 0.5", "models: [{{model: {a}}}, {{model: {b}}}]\n"),
            origin=BASIC,
        ),
    )


BASIC_ONLY = (
    Case(
        "basic-passthrough-copy",
        "gpt2",
        "merge_method: passthrough\nmodels: [{{model: {a}}}]\ndtype: bfloat16\n",
        origin=BASIC,
    ),
    Case(
        "basic-passthrough-stack",
        "gpt2",
        "merge_method: passthrough\nslices:\n"
        "  - sources: [{{model: {a}, layer_range: [0, 4]}}]\n  - sources: [{{model: {a}, layer_range: [0, 4]}}]\n"
        "dtype: bfloat16\n",
        origin=BASIC,
    ),
    Case(
        "basic-passthrough-scale",
        "llama",
        "merge_method: passthrough\nmodels:\n  - model: {a}\n    parameters:\n"
        "      scale: [{{filter: o_proj, value: 0}}, {{value: 1}}]\n",
        origin=BASIC,
    ),
    Case(
        "basic-sce",
        "llama",
        _two("sce", "base", "select_topk: 0.5"),
        origin=BASIC,
        ignored=WEIGHTS_IGNORED,
        trimmed=("a", "b"),
        density=0.5,
        selection="variance",
    ),
    Case("basic-ram", "llama", _two("ram", "base"), origin=BASIC, ignored=WEIGHTS_IGNORED),
    Case(
        "basic-ramplus-tl",
        "llama",
        _two("ramplus_tl", "base", "r: 0.05, alpha: 1.0"),
        origin=BASIC,
        ignored=WEIGHTS_IGNORED,
    ),
    Case("basic-multislerp", "llama", _two("multislerp", "base"), origin=BASIC),
    Case(
        "basic-arcee-fusion",
        "llama",
        _two("arcee_fusion", "a"),
        origin=BASIC,
        ignored=WEIGHTS_IGNORED,
    ),
    Case("basic-nearswap", "llama", _two("nearswap", "a", "t: 0.0001"), origin=BASIC, ignored=WEIGHTS_IGNORED),
    Case(
        "basic-della",
        "llama-wide",
        _two("della", "base", "density: 0.66, epsilon: 0.05, lambda: 0.5"),
        random=True,
        origin=BASIC,
    ),
    Case(
        "basic-della-invalid-epsilon",
        "llama",
        _two("della", "base", "density: 0.66, epsilon: 1.35, lambda: 0.5"),
        origin=BASIC,
        refused="parameters.epsilon",
    ),
    Case(
        "basic-karcher",
        "llama",
        _two("karcher", "base", "max_iter: 5, tol: 1.0e-5"),
        origin=BASIC,
        ignored=WEIGHTS_IGNORED,
    ),
    Case(
        "basic-ties-fp32",  # the same recipe computed in float32: no rounding between the steps
        "llama",
        _two("ties", "base", "density: 0.3", dtype="float32"),
        origin=BASIC,
    ),
)

EXAMPLES = (  # mergekit's examples/*.yml, float16 as there; their models become pico Llamas
    Case(
        "example-gradient-slerp",
        "llama",
        "merge_method: slerp\nbase_model: {a}\nslices:\n  - sources:\n"
        "      - {{model: {a}, layer_range: [0, 4]}}\n      - {{model: {b}, layer_range: [0, 4]}}\nparameters:\n"
        "  t:\n    - filter: self_attn\n      value: [0, 0.5, 0.3, 0.7, 1]\n    - filter: mlp\n"
        "      value: [1, 0.5, 0.7, 0.3, 0]\n    - value: 0.5\ndtype: float16\n",
        origin="examples/gradient-slerp.yml",
    ),
    Case(
        "example-ties",
        "llama",
        "merge_method: ties\nbase_model: {base}\nmodels:\n"
        "  - model: {a}\n    parameters:\n      density: [1, 0.7, 0.1]\n      weight: 1.0\n  - model: {b}\n"
        "    parameters:\n      density: 0.5\n      weight: [0, 0.3, 0.7, 1]\n  - model: {c}\n    parameters:\n"
        "      density: 0.33\n      weight:\n        - filter: mlp\n          value: 0.5\n        - value: 0\n"
        "parameters:\n  normalize: true\n  int8_mask: true\ndtype: float16\n",
        origin="examples/ties.yml",
        trimmed=("a", "b", "c"),
        density=None,
    ),
    Case(
        "example-linear",
        "llama",
        "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0}}\n"
        "  - model: {b}\n    parameters: {{weight: 0.3}}\n  - model: {c}\n    parameters: {{weight: 0.5}}\n"
        "dtype: float16\n",
        origin="examples/linear.yml",
    ),
    Case(
        "example-orcamini-44layer",
        "llama",
        "merge_method: passthrough\nslices:\n"
        "  - sources: [{{model: {a}, layer_range: [0, 3]}}]\n  - sources: [{{model: {b}, layer_range: [2, 4]}}]\n"
        "dtype: float16\n",
        origin="examples/orcamini-platy-44layer.yml",
    ),
    Case(
        "example-bio-merge",
        "llama",
        "merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{density: 0.5, weight: 0.5}}\n  - model: {b}\n    parameters: {{density: 0.5, weight: 0.5}}\n"
        "parameters: {{normalize: false, int8_mask: true}}\ndtype: float16\n",
        origin="examples/bio-merge.yml",
        trimmed=("a", "b"),
        density=0.5,
    ),
    Case(
        "example-arcee-fusion",
        "llama",
        "merge_method: arcee_fusion\nbase_model: {a}\nmodels: [{{model: {a}}}, {{model: {b}}}]\ndtype: bfloat16\n",
        origin="examples/arcee_fusion.yml",
    ),
)

RECIPE_FORMS = (
    Case(
        "slerp-partial-depth",
        "llama",
        "merge_method: slerp\nbase_model: {a}\nslices:\n  - sources:\n"
        "      - {{model: {a}, layer_range: [0, 3]}}\n      - {{model: {b}, layer_range: [0, 3]}}\n"
        "parameters: {{t: 0.3}}\ndtype: float32\n",
    ),
    Case(
        "slerp-several-slices",
        "llama",
        "merge_method: slerp\nbase_model: {a}\nslices:\n  - sources:\n"
        "      - {{model: {a}, layer_range: [0, 2]}}\n      - {{model: {b}, layer_range: [0, 2]}}\n"
        "    parameters: {{t: 0.1}}\n  - sources:\n      - {{model: {a}, layer_range: [2, 4]}}\n"
        "      - {{model: {b}, layer_range: [1, 3]}}\n    parameters: {{t: [0.2, 0.9]}}\nparameters: {{t: 0.5}}\n"
        "dtype: float32\n",
    ),
    Case(
        "ties-slice-precedence",
        "llama",
        "merge_method: ties\nbase_model: {base}\nslices:\n  - sources:\n"
        "      - {{model: {base}, layer_range: [0, 4]}}\n"
        "      - {{model: {a}, layer_range: [0, 4], parameters: {{weight: 0.9, density: 0.4}}}}\n"
        "      - {{model: {b}, layer_range: [0, 4]}}\n    parameters: {{weight: 0.5, density: 0.7}}\n"
        "parameters: {{weight: 0.1, density: 0.2, normalize: false, lambda: 0.8}}\ndtype: float32\n",
    ),
    Case(
        "task-arithmetic-filters",
        "qwen2",
        "merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
        "  - model: {a}\n    parameters:\n      weight: [{{filter: self_attn, value: [0.2, 0.8]}}, {{value: 0.5}}]\n"
        "  - model: {b}\nparameters: {{weight: 0.3, lambda: 1.2, normalize: true}}\ndtype: float32\n",
    ),
    Case(
        "passthrough-scale",
        "llama",
        "merge_method: passthrough\nslices:\n"
        "  - sources: [{{model: {a}, layer_range: [0, 2], parameters: {{scale: 0.5}}}}]\n"
        "  - sources: [{{model: {b}, layer_range: [2, 4]}}]\n"
        "    parameters: {{scale: [{{filter: o_proj, value: 0.0}}, {{filter: down_proj, value: 2.0}}]}}\n"
        "parameters: {{scale: 1.5}}\ndtype: float32\n",
    ),
    Case(
        "gpt2-ties",
        "gpt2",
        "merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.7, density: 0.5}}\n  - model: {b}\n    parameters: {{weight: 0.3, density: 0.5}}\n"
        "dtype: float32\n",
    ),
    Case(
        "mistral-ties-float16",  # computed in float16, written in float32
        "mistral",
        "merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.5, density: 0.5}}\n  - model: {b}\n    parameters: {{weight: 0.5, density: 0.5}}\n"
        "dtype: float16\nout_dtype: float32\n",
        trimmed=("a", "b"),
        density=0.5,
    ),
    Case(
        "linear-out-dtype",
        "llama",
        "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 2}}\n"
        "  - model: {b}\n    parameters: {{weight: 1}}\ndtype: float32\nout_dtype: bfloat16\n",
    ),
    Case(
        "breadcrumbs-ties",
        "llama",
        "merge_method: breadcrumbs_ties\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.5, density: 0.8, gamma: 0.05}}\n  - model: {b}\n"
        "    parameters: {{weight: 0.5, density: 0.8, gamma: 0.05}}\ndtype: float32\n",
    ),
    Case(
        "model-stock",
        "llama",
        "merge_method: model_stock\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "  - model: {b}\n  - model: {c}\ndtype: float32\n",
    ),
    Case(
        "nuslerp",
        "llama",
        "merge_method: nuslerp\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.3}}\n  - model: {b}\n    parameters: {{weight: 0.7}}\ndtype: float32\n",
    ),
    Case(
        "multislerp",
        "llama",
        "merge_method: multislerp\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.3}}\n  - model: {b}\n    parameters: {{weight: 0.5}}\n  - model: {c}\n"
        "    parameters: {{weight: 0.2}}\ndtype: float32\n",
    ),
    Case(
        "karcher",
        "llama",
        "merge_method: karcher\nmodels: [{{model: {a}}}, {{model: {b}}}, {{model: {c}}}]\n"
        "parameters: {{max_iter: 20, tol: 1.0e-6}}\ndtype: float32\n",
    ),
    Case(
        "sce",
        "llama",
        "merge_method: sce\nbase_model: {base}\nmodels: [{{model: {a}}}, {{model: {b}}}, {{model: {c}}}]\n"
        "parameters: {{select_topk: 0.5}}\ndtype: float32\n",
    ),
    Case(
        "nearswap",
        "llama",
        "merge_method: nearswap\nbase_model: {base}\nmodels: [{{model: {base}}}, {{model: {a}}}]\n"
        "parameters: {{t: 0.01}}\ndtype: float32\n",
    ),
    Case(
        "arcee-fusion",
        "llama",
        "merge_method: arcee_fusion\nbase_model: {base}\nmodels: [{{model: {base}}}, {{model: {a}}}]\ndtype: float32\n",
    ),
    Case(
        "della",
        "llama-wide",
        "merge_method: della\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.5, density: 0.5, epsilon: 0.1}}\n  - model: {b}\n"
        "    parameters: {{weight: 0.5, density: 0.5, epsilon: 0.1}}\nparameters: {{lambda: 1.0}}\ndtype: float32\n",
        random=True,
    ),
    # several layer stacks: each gets its own depth for gradients (mergekit plans one module each)
    Case(
        "mistral3-gradient-slerp",
        "mistral3",
        "merge_method: slerp\nbase_model: {base}\n"
        "models: [{{model: {base}}}, {{model: {a}}}]\nparameters: {{t: [0.0, 1.0]}}\ndtype: float32\n",
    ),
    Case(
        "mistral3-slices",
        "mistral3",
        "merge_method: passthrough\nslices:\n  - sources: [{{model: {a}, layer_range: [0, 2]}}]\ndtype: float32\n",
        refused="slices",
    ),
    # LoRA inputs (``model+adapter``): mergekit folds the adapter in with peft before merging
    Case(
        "lora-linear",
        "llama",
        "merge_method: linear\nmodels:\n  - model: {base}+{lora}\n"
        "    parameters: {{weight: 0.5}}\n  - model: {a}\n    parameters: {{weight: 0.5}}\ndtype: float32\n",
    ),
    Case(
        "rslora-task-arithmetic",
        "llama",
        "merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
        "  - model: {base}+{rslora}\n    parameters: {{weight: 0.7}}\n  - model: {b}\n    parameters: {{weight: 0.3}}\n"
        "dtype: float32\n",
    ),
    Case(
        "dare-linear",
        "llama-wide",
        "merge_method: dare_linear\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{weight: 0.6, density: 0.4}}\n  - model: {b}\n    parameters: {{weight: 0.4, density: 0.4}}\n"
        "dtype: float32\n",
        random=True,
    ),
)

CASES: tuple[Case, ...] = (
    *BASIC_ONLY[:2],
    *_granite(),
    *_basic("llama", "basic-"),
    *BASIC_ONLY[2:],
    *_basic("mistral3", "vlm-"),
    *EXAMPLES,
    *RECIPE_FORMS,
)
