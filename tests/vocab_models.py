"""Tiny models with real tokenizer files and different vocabularies, built offline: a BPE tokenizer (its own
vocabulary, a few merges, optional added tokens) wrapped in ``PreTrainedTokenizerFast``, and a Llama (untied LM
head) or Qwen2 (tied) checkpoint whose embedding rows fit it (``rows`` may exceed the tokenizer: padded or resized
embeddings). A "fine-tune" copies the base's rows for the tokens both share, so their task vectors are small."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("a") + 26)]
MERGES = [("a", "b"), ("c", "d"), ("ab", "cd"), ("e", "f")]
BASE_TOKENS = WORDS + ["".join(m) for m in MERGES]  # 33 tokens


def build_tokenizer(extra: tuple[str, ...] = (), added: tuple[str, ...] = (), special: tuple[str, ...] = ()):
    """``extra``: more words in the BPE vocabulary itself; ``added``/``special``: added tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = BASE_TOKENS + list(extra)
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, list(MERGES), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if added:
        tokenizer.add_tokens(list(added))
    if special:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in special]}
        )
    return tokenizer


def pico_config(arch: str, rows: int):
    import transformers

    common = dict(
        vocab_size=rows,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.LlamaConfig(**common, tie_word_embeddings=False)


def build_vocab_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    base: Path | None = None,
    extra: tuple[str, ...] = (),
    added: tuple[str, ...] = (),
    special: tuple[str, ...] = (),
    rows: int | None = None,
    chat_template: str | None = None,
    noise: float = 0.05,
) -> Path:
    """A model with its tokenizer; ``rows`` (default: the tokenizer's size) embedding rows."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = build_tokenizer(extra, added, special)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    vocab = tokenizer.get_vocab()
    rows = rows or len(vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(pico_config(arch, rows))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        if base is not None:
            parent = transformers.AutoModelForCausalLM.from_pretrained(str(base))
            parent_vocab = json.loads((base / "tokenizer.json").read_text())
            parent_ids = _ids(parent_vocab)
            state, parent_state = model.state_dict(), parent.state_dict()
            for name, tensor in state.items():
                source = parent_state[name]
                if tensor.shape == source.shape and not _is_vocab(name):
                    tensor.copy_(source + noise * torch.randn(tensor.shape, generator=generator))
                elif _is_vocab(name):  # shared tokens start from the parent's rows
                    for token, index in vocab.items():
                        if token in parent_ids and parent_ids[token] < source.shape[0] and index < rows:
                            tensor[index] = source[parent_ids[token]] + noise * torch.randn(
                                tensor.shape[1:], generator=generator
                            )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _is_vocab(name: str) -> bool:
    return name.endswith("embed_tokens.weight") or name.startswith("lm_head.")


def _ids(tokenizer_json: dict) -> dict[str, int]:
    ids = dict(tokenizer_json["model"]["vocab"])
    ids.update({entry["content"]: entry["id"] for entry in tokenizer_json.get("added_tokens", [])})
    return ids
