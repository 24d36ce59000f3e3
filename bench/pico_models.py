"""Pico models for the mergekit differential bench and conformance tests: seeded random models built with
``transformers`` config classes (nothing is downloaded), each family a base and three small "fine-tunes" of it, and
PEFT-layout LoRA adapters of the Llama base."""

from __future__ import annotations

import json
from pathlib import Path


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
    if arch == "granite":  # mergekit's picogranite, at the bench's size
        return transformers.GraniteConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
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
