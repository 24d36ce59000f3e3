"""Tiny random transformer checkpoints built offline with ``transformers`` config classes.

Used by the tests, the demo zoo of ``make run`` and the CI benchmark preset. Every model is seeded, written with
``save_pretrained(safe_serialization=True)`` and therefore a real Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Architecture = Literal["llama", "mistral", "gpt2", "bert"]


def tiny_config(arch: Architecture, *, layers: int = 2, hidden: int = 32, vocab: int = 128):
    # lazy: transformers costs seconds to import; only model loading needs it
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            sliding_window=64,
        )
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=128)
    if arch == "bert":
        return transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=128,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny_model(
    out_dir: str | Path,
    arch: Architecture = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    vocab: int = 128,
    max_shard_size: str | int | None = None,
    base: str | Path | None = None,
    noise: float = 0.02,
) -> Path:
    """Write a tiny random model; with ``base``, a "fine-tune" of it: base weights plus seeded noise of
    scale ``noise`` (so task vectors are small and merges are meaningful)."""
    # lazy: torch loads only in processes that handle tensors
    import torch
    import transformers

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = tiny_config(arch, layers=layers, hidden=hidden, vocab=vocab)
    model: transformers.PreTrainedModel
    if base is not None:
        model_cls = transformers.BertModel if arch == "bert" else transformers.AutoModelForCausalLM
        model = model_cls.from_pretrained(str(base))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    else:
        model = (
            transformers.BertModel(config) if arch == "bert" else transformers.AutoModelForCausalLM.from_config(config)
        )
    if max_shard_size is None:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    else:
        model.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size=max_shard_size)
    return out_dir
