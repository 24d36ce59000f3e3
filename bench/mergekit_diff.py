"""Differential benchmark: the same mergekit recipes through mergekit 0.1.5 (its own venv, ``mergekit-yaml``) and
Alloy (``alloy merge``), on the same pico models built with ``transformers`` config classes, compared per tensor.

    python bench/mergekit_diff.py [--only NAME,NAME] [--root DIR]

For each recipe it prints: whether the two outputs have the same tensors and config layer count, the largest
absolute difference, how many elements differ, and (each tool run in its own process, one after the other) the
wall-time and peak-RSS ratios Alloy/mergekit. Deterministic recipes must agree within 1e-6 in float32 (one
bfloat16 step for bfloat16 recipes); random recipes (DARE, DELLA) draw different bits in the two tools, so their
kept fraction and the L1 norm of ``merged - base`` are compared instead (within 0.5%).

mergekit's Python is ``$ALLOY_MERGEKIT_PYTHON`` or ``/work/mkvenv/bin/python``; the project never imports it.
The recipes reconstruct mergekit's ``tests/test_basic_merges.py`` configurations and its ``examples/``, plus the
recipe forms Alloy documents (several slices, partial depth, filters and gradients at every level, scale).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MERGEKIT_PYTHON = "/work/mkvenv/bin/python"
DETERMINISTIC_ATOL = 1e-6
RANDOM_RTOL = 0.005


def mergekit_python() -> Path | None:
    """mergekit's interpreter when one is installed (env ``ALLOY_MERGEKIT_PYTHON`` first), else None."""
    candidate = Path(os.environ.get("ALLOY_MERGEKIT_PYTHON", DEFAULT_MERGEKIT_PYTHON))
    if not candidate.is_file():
        return None
    probe = subprocess.run([str(candidate), "-c", "import mergekit"], capture_output=True)
    return candidate if probe.returncode == 0 else None


# --- pico models ------------------------------------------------------------------------------------------------


def pico_config(arch: str, layers: int = 4):
    import transformers

    if arch == "llama":  # grouped-query attention
        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    if arch == "llama-wide":  # enough entries (1.4M) for the statistics of random methods to settle
        return transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=64,
        )
    if arch == "qwen2":  # tied embeddings: no lm_head tensor in the checkpoint
        return transformers.Qwen2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    if arch == "gpt2":  # fused c_attn, Conv1D layout
        return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=64)
    if arch == "mistral3":  # LLaVA-style: a Pixtral vision tower (2 layers), a projector and a Mistral LM (3 layers)
        text = transformers.MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        vision = transformers.PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            head_dim=16,
        )
        return transformers.Mistral3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=2
        )
    raise ValueError(f"unknown pico architecture {arch!r}")


def model_class(arch: str):
    import transformers

    return transformers.Mistral3ForConditionalGeneration if arch == "mistral3" else transformers.AutoModelForCausalLM


def build_pico(out_dir: Path, arch: str, seed: int, base: Path | None = None, noise: float = 0.02) -> Path:
    """A seeded random model; with ``base``, base plus seeded noise (a "fine-tune" with a small task vector)."""
    import torch

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    if base is not None:
        model = model_class(arch).from_pretrained(str(base))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    else:
        config = pico_config(arch)
        model = model_class(arch)(config) if arch == "mistral3" else model_class(arch).from_config(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


LORA_TARGETS = ("q_proj", "v_proj", "up_proj", "down_proj")  # square and non-square projections


def build_pico_adapter(
    out_dir: Path, base: Path, seed: int, rank: int = 4, alpha: float = 8.0, rslora: bool = False
) -> Path:
    """A PEFT-layout LoRA adapter of ``base`` (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's
    tensor names), written with plain safetensors: B is random too (PEFT starts it at zero), so the delta shows."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    if (out_dir / "adapter_config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in sorted(load_file(str(base / "model.safetensors")).items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LORA_TARGETS:
            out_features, in_features = weight.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) * 0.1
            )
            tensors[f"base_model.model.{module}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=generator) * 0.1
            )
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(LORA_TARGETS),
                "fan_in_fan_out": False,
                "use_rslora": rslora,
            },
            indent=2,
        )
    )
    return out_dir


def pico_family(root: Path, arch: str) -> dict[str, Path]:
    """``base`` and three fine-tunes ``a``, ``b``, ``c`` of it; for Llama also LoRA adapters of ``base``
    (``lora``, and ``rslora`` with rsLoRA's scaling)."""
    base = build_pico(root / f"{arch}-base", arch, seed=0)
    family = {
        "base": base,
        **{
            name: build_pico(root / f"{arch}-{name}", arch, seed=s, base=base)
            for name, s in (("a", 1), ("b", 2), ("c", 3))
        },
    }
    if arch == "llama":
        family["lora"] = build_pico_adapter(root / f"{arch}-lora", base, seed=4)
        family["rslora"] = build_pico_adapter(root / f"{arch}-rslora", base, seed=5, rslora=True)
    return family


# --- recipes ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    recipe: str  # mergekit YAML; {base} {a} {b} {c} are model paths
    random: bool = False
    origin: str = "alloy"  # where the configuration comes from
    refused: str | None = None  # the key Alloy refuses (mergekit silently ignores it), named in details.field
    known_difference: str | None = None  # why the tensors are expected to differ (reported, not hidden)

    def text(self, models: dict[str, Path]) -> str:
        return self.recipe.format(**{k: str(v) for k, v in models.items()})


TWO = "models:\n  - model: {a}\n    parameters: {{weight: 0.6}}\n  - model: {b}\n    parameters: {{weight: 0.4}}\n"

CASES: tuple[Case, ...] = (
    # mergekit tests/test_basic_merges.py (picollama there; bfloat16 as there)
    Case(
        "basic-passthrough-copy",
        "gpt2",
        "merge_method: passthrough\nmodels: [{{model: {a}}}]\ndtype: bfloat16\n",
        origin="test_basic_merges",
    ),
    Case(
        "basic-passthrough-stack",
        "gpt2",
        "merge_method: passthrough\nslices:\n"
        "  - sources: [{{model: {a}, layer_range: [0, 4]}}]\n  - sources: [{{model: {a}, layer_range: [0, 4]}}]\n"
        "dtype: bfloat16\n",
        origin="test_basic_merges",
    ),
    Case("basic-linear", "llama", f"merge_method: linear\n{TWO}dtype: bfloat16\n", origin="test_basic_merges"),
    # mergekit ignores slerp's weights; Alloy refuses them by name
    Case(
        "basic-slerp",
        "llama",
        f"merge_method: slerp\nbase_model: {{a}}\n{TWO}parameters: {{{{t: 0.35}}}}\ndtype: bfloat16\n",
        origin="test_basic_merges",
        refused="models.0.parameters.weight",
    ),
    Case(
        "basic-slerp-no-weights",
        "llama",
        "merge_method: slerp\nbase_model: {a}\nmodels: [{{model: {a}}}, "
        "{{model: {b}}}]\nparameters: {{t: 0.35}}\ndtype: bfloat16\n",
        origin="test_basic_merges",
    ),
    Case(
        "basic-task-arithmetic",
        "llama",
        f"merge_method: task_arithmetic\nbase_model: {{base}}\n{TWO}dtype: bfloat16\n",
        origin="test_basic_merges",
    ),
    Case(
        "basic-ties",
        "llama",
        f"merge_method: ties\nbase_model: {{base}}\n{TWO}parameters: {{{{density: 0.3}}}}\ndtype: bfloat16\n",
        origin="test_basic_merges",
        known_difference="mergekit does TIES arithmetic in bfloat16 (task vectors, top-k with many tied "
        "magnitudes, sign sums); Alloy rounds the inputs to bfloat16 and computes in float32",
    ),
    Case(
        "basic-ties-fp32",
        "llama",
        f"merge_method: ties\nbase_model: {{base}}\n{TWO}parameters: {{{{density: 0.3}}}}\ndtype: float32\n",
        origin="test_basic_merges",
    ),
    Case(
        "basic-dare-ties",
        "llama-wide",
        f"merge_method: dare_ties\nbase_model: {{base}}\n{TWO}parameters: {{{{density: 0.66}}}}\n",
        random=True,
        origin="test_basic_merges",
    ),
    # mergekit examples/ (gradient-slerp, ties, linear, bio-merge, orcamini-platypus)
    Case(
        "example-gradient-slerp",
        "mistral",
        "merge_method: slerp\nbase_model: {a}\nslices:\n  - sources:\n"
        "      - {{model: {a}, layer_range: [0, 4]}}\n      - {{model: {b}, layer_range: [0, 4]}}\nparameters:\n"
        "  t:\n    - filter: self_attn\n      value: [0, 0.5, 0.3, 0.7, 1]\n    - filter: mlp\n"
        "      value: [1, 0.5, 0.7, 0.3, 0]\n    - value: 0.5\ndtype: float32\n",
        origin="examples/gradient-slerp.yml",
    ),
    Case(
        "example-ties",
        "llama",
        "merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {base}\n"
        "  - model: {a}\n    parameters:\n      density: [1, 0.7, 0.1]\n      weight: 1.0\n  - model: {b}\n"
        "    parameters:\n      density: 0.5\n      weight: [0, 0.3, 0.7, 1]\n  - model: {c}\n    parameters:\n"
        "      density: 0.33\n      weight:\n        - filter: mlp\n          value: 0.5\n        - value: 0\n"
        "parameters:\n  normalize: true\n  int8_mask: true\ndtype: float32\n",
        origin="examples/ties.yml",
    ),
    Case(
        "example-linear",
        "llama",
        "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0}}\n"
        "  - model: {b}\n    parameters: {{weight: 0.3}}\n  - model: {c}\n    parameters: {{weight: 0.5}}\n"
        "dtype: float32\n",
        origin="examples/linear.yml",
    ),
    Case(
        "example-orcamini-stack",
        "llama",
        "merge_method: passthrough\nslices:\n"
        "  - sources: [{{model: {a}, layer_range: [0, 3]}}]\n  - sources: [{{model: {b}, layer_range: [1, 4]}}]\n"
        "dtype: float32\n",
        origin="examples/orcamini-platypus-13b.yml",
    ),
    Case(
        "example-bio-merge",
        "llama",
        "merge_method: dare_ties\nbase_model: {base}\nmodels:\n  - model: {a}\n"
        "    parameters: {{density: 0.53, weight: 0.4}}\n  - model: {b}\n    parameters: {{density: 0.53, weight: 0.3}}\n"
        "  - model: {c}\n    parameters: {{density: 0.53, weight: 0.3}}\nparameters: {{int8_mask: true}}\n"
        "dtype: float32\n",
        random=True,
        origin="examples/bio-merge.yml",
    ),
    # recipe forms
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


# --- running ----------------------------------------------------------------------------------------------------


def run_measured(command: list[str], cwd: Path | None = None) -> tuple[float, int, str]:
    """``(wall seconds, peak RSS bytes, output)`` of one child process (its own rusage, from ``wait4``)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({process.returncode}):\n{output[-3000:]}")
    return wall, usage.ru_maxrss * 1024, output


def mergekit_command(python: Path, config: Path, out: Path) -> list[str]:
    return [str(python.parent / "mergekit-yaml"), str(config), str(out), *mergekit_options(out.parent / "lora-cache")]


def mergekit_options(lora_cache: Path) -> list[str]:
    """mergekit-yaml's options for every run (it merges LoRA inputs into full copies under ``lora_cache``)."""
    return [
        "--allow-crimes",
        "--no-copy-tokenizer",
        "--quiet",
        "--random-seed",
        "0",
        "--lora-merge-cache",
        str(lora_cache),
    ]


def alloy_command(config: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "alloy.cli.main", "merge", str(config), str(out), "--quiet"]


BATCH_DRIVER = """
import json, sys, traceback
from mergekit.scripts.run_yaml import main
failed = 0
options = json.load(open(sys.argv[2]))
for config, out in json.load(open(sys.argv[1])):
    try:
        main.main([config, out, *options], standalone_mode=False)
    except Exception:
        failed += 1
        print("FAILED", config, file=sys.stderr)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""


def run_mergekit_batch(python: Path, jobs: list[tuple[Path, Path]], scratch: Path) -> str:
    """Every (config, out) through mergekit-yaml's own command function in one mergekit process (one import of
    torch for all of them: what keeps the conformance test short). One failing recipe does not stop the others."""
    listing = scratch / "mergekit-jobs.json"
    listing.write_text(json.dumps([[str(c), str(o)] for c, o in jobs]))
    options = scratch / "mergekit-options.json"
    options.write_text(json.dumps(mergekit_options(scratch / "lora-cache")))
    driver = scratch / "mergekit_batch.py"
    driver.write_text(BATCH_DRIVER)
    result = subprocess.run([str(python), str(driver), str(listing), str(options)], capture_output=True, text=True)
    return result.stderr if result.returncode != 0 else ""  # the failed recipes have no output folder


# --- comparing --------------------------------------------------------------------------------------------------


def load_folder(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def layer_count(folder: Path) -> int | None:
    config = json.loads((Path(folder) / "config.json").read_text())
    return next((config[k] for k in ("num_hidden_layers", "n_layer") if isinstance(config.get(k), int)), None)


def compare(alloy_dir: Path, mergekit_dir: Path, *, random: bool, base_dir: Path | None) -> dict[str, Any]:
    """Per-tensor comparison; for random recipes, the kept fraction and L1 norm of ``merged - base`` too."""
    import torch

    ours, theirs = load_folder(alloy_dir), load_folder(mergekit_dir)
    report: dict[str, Any] = {
        "same_tensors": set(ours) == set(theirs),
        "only_alloy": sorted(set(ours) - set(theirs)),
        "only_mergekit": sorted(set(theirs) - set(ours)),
        "layers": (layer_count(alloy_dir), layer_count(mergekit_dir)),
        "dtypes_equal": all(ours[n].dtype == theirs[n].dtype for n in set(ours) & set(theirs)),
        "max_abs_diff": 0.0,
        "elements_differing": 0,
        "elements": 0,
        "bf16": False,
    }
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name], theirs[name]
        if a.shape != b.shape:
            report["max_abs_diff"] = float("inf")
            continue
        report["bf16"] |= a.dtype == torch.bfloat16
        diff = (a.double() - b.double()).abs()
        report["max_abs_diff"] = max(report["max_abs_diff"], float(diff.max()) if diff.numel() else 0.0)
        report["elements_differing"] += int((diff > 0).sum())
        report["elements"] += diff.numel()
    if random and base_dir is not None:
        base = load_folder(base_dir)
        for label, merged in (("alloy", ours), ("mergekit", theirs)):
            kept = total = 0
            l1 = 0.0
            for name, tensor in merged.items():
                if name in base and base[name].shape == tensor.shape and tensor.is_floating_point():
                    delta = tensor.double() - base[name].double()
                    kept += int((delta != 0).sum())
                    total += delta.numel()
                    l1 += float(delta.abs().sum())
            report[f"{label}_kept_fraction"] = kept / max(total, 1)
            report[f"{label}_l1"] = l1
        report["kept_rel_diff"] = abs(report["alloy_kept_fraction"] / report["mergekit_kept_fraction"] - 1)
        report["l1_rel_diff"] = abs(report["alloy_l1"] / report["mergekit_l1"] - 1)
    report["ok"] = verdict(report, random)
    return report


def verdict(report: dict[str, Any], random: bool) -> bool:
    if not report["same_tensors"] or report["layers"][0] != report["layers"][1] or not report["dtypes_equal"]:
        return False
    if random:
        return report["kept_rel_diff"] <= RANDOM_RTOL and report["l1_rel_diff"] <= RANDOM_RTOL
    # a bfloat16 result may round the other way: one bfloat16 step of values below 8 in magnitude
    tolerance = 2.0**-5 if report["bf16"] else DETERMINISTIC_ATOL
    return report["max_abs_diff"] <= tolerance


# --- the benchmark ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/alloy-mergekit-diff"))
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args()
    python = mergekit_python()
    if python is None:
        sys.exit("mergekit is not installed (set ALLOY_MERGEKIT_PYTHON to a python with mergekit 0.1.5)")
    wanted = {n for n in args.only.split(",") if n}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    args.root.mkdir(parents=True, exist_ok=True)
    families = {arch: pico_family(args.root / "models", arch) for arch in sorted({c.arch for c in cases})}
    header = (
        f"{'recipe':28} {'origin':22} {'tensors':8} {'layers':7} {'max|diff|':>10} {'differ':>14} "
        f"{'kept/L1 rel':>13} {'time x':>7} {'RSS x':>6} ok"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        models = families[case.arch]
        work = args.root / "runs" / case.name
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir(parents=True)
        config = work / "recipe.yml"
        config.write_text(case.text(models))
        if case.refused:
            refusal = subprocess.run(alloy_command(config, work / "alloy"), capture_output=True, text=True)
            said = (refusal.stdout + refusal.stderr).strip().splitlines()[-1:] or [""]
            theirs = subprocess.run(mergekit_command(python, config, work / "mergekit"), capture_output=True)
            print(
                f"{case.name:28} {case.origin:22} refused by Alloy ({case.refused}); mergekit "
                f"{'merges it' if theirs.returncode == 0 else 'refuses it too'}: {said[0][:60]}"
            )
            continue
        try:
            mk_wall, mk_rss, _ = run_measured(mergekit_command(python, config, work / "mergekit"))
            al_wall, al_rss, _ = run_measured(alloy_command(config, work / "alloy"))
        except RuntimeError as exc:
            print(f"{case.name:28} {case.origin:22} FAILED: {str(exc).splitlines()[-1][:80]}")
            continue
        report = compare(work / "alloy", work / "mergekit", random=case.random, base_dir=models["base"])
        stats = f"{report['kept_rel_diff']:.2%}/{report['l1_rel_diff']:.2%}" if case.random else "-"
        layers = "=" if report["layers"][0] == report["layers"][1] else f"{report['layers']}"
        print(
            f"{case.name:28} {case.origin:22} {'equal' if report['same_tensors'] else 'DIFFER':8} {layers:7} "
            f"{report['max_abs_diff']:>10.2e} {report['elements_differing']:>6}/{report['elements']:<7} "
            f"{stats:>13} {al_wall / mk_wall:>7.2f} {al_rss / mk_rss:>6.2f} {'yes' if report['ok'] else 'NO'}"
        )
        (work / "report.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
