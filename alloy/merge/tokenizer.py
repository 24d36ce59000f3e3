"""The output vocabulary of a merge with ``tokenizer_source`` / ``tokenizer:``, built as mergekit 0.1.5 builds it,
and where each of its tokens sits in every input model.

* The base tokenizer (``base_model``, else the first model) is stripped of the tokens whose id is not below its
  config's ``vocab_size`` (rows the model does not have; BPE tokenizers only, as in mergekit).
* ``base``: the stripped base tokenizer. ``<model>``: that model's tokenizer, as it is. ``union``: the base
  tokenizer, then every other token of the inputs (ids below their ``vocab_size``) added to it: first the tokens
  no input has as an added token (input by input, base first then in recipe order, each input's in id order),
  then every input's added tokens with their settings (special, normalized, ...; the first input's settings win).
* Every token named under ``tokens:`` joins the vocabulary when it is not in it.

mergekit orders the inputs of a union (after the base) and each input's plain tokens by hash order, which changes
from run to run; Alloy's order is the recipe's and the ids', so its ids are the same every time.

Tokenizers are loaded with ``transformers`` (fast tokenizers, no remote code) from the models' folders; an input
whose folder has no loadable tokenizer counts as having the base's vocabulary (as in mergekit).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.merge.tokenizer_config import BASE, UNION, TokenizerSettings


def _refuse(message: str, **details: Any) -> AlloyError:
    return AlloyError(ErrorCode.VALIDATION_FAILED, message, {"field": "tokenizer", **details})


def config_vocab_size(folder: Path) -> int | None:
    """``vocab_size`` from config.json (a multimodal model's ``text_config.vocab_size``)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for holder in (config, config.get("text_config") or {}):
        if isinstance(holder.get("vocab_size"), int):
            return holder["vocab_size"]
    return None


def load_tokenizer(folder: Path, model_id: str):
    # lazy: transformers costs seconds to import; only merges with tokenizer settings need it
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), use_fast=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - any loader failure means "this folder has no usable tokenizer"
        return None


def _strip(tokenizer, vocab_size: int | None, model_id: str):
    """The tokenizer without the tokens at ids >= ``vocab_size`` (the model has no rows for them)."""
    from tokenizers import Tokenizer

    size = vocab_size or len(tokenizer.get_vocab())
    unused = {token for token, index in tokenizer.get_vocab().items() if index >= size}
    if not unused:
        return tokenizer
    data = json.loads(tokenizer._tokenizer.to_str())
    if data["model"]["type"] != "BPE":
        raise _refuse(
            f"the base {model_id!r} has tokenizer entries beyond its vocab_size {size}, and only a BPE tokenizer "
            f"can be cut down to its rows (this one is {data['model']['type']})",
            model=model_id,
        )
    data["added_tokens"] = [entry for entry in data["added_tokens"] if entry["id"] < size]
    data["model"]["vocab"] = {token: i for token, i in data["model"]["vocab"].items() if token not in unused}

    def keeps(merge: Any) -> bool:
        parts = merge.split(" ") if isinstance(merge, str) else merge
        return not any(part in unused for part in parts)

    data["model"]["merges"] = [merge for merge in data["model"]["merges"] if keeps(merge)]
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(data))
    return tokenizer


def _copy(tokenizer):
    """An independent copy (saved and loaded again), so that adding tokens leaves the original alone."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        return AutoTokenizer.from_pretrained(scratch, use_fast=True, trust_remote_code=False)


@dataclass
class OutputVocabulary:
    """The output tokenizer, its vocabulary, and every input's token ids (ids at or past an input's
    ``vocab_size`` are in ``beyond``: the model has no row for them)."""

    tokenizer: Any
    vocab: dict[str, int]
    rows: int  # embedding rows of the output: the vocabulary padded to pad_to_multiple_of
    token_ids: dict[str, dict[str, int]] = field(default_factory=dict)
    beyond: dict[str, dict[str, int]] = field(default_factory=dict)
    original: dict[str, dict[str, int]] = field(default_factory=dict)  # each loaded tokenizer's own vocabulary
    base_id: str = ""


def _union(base_id: str, base, tokenizers: Mapping[str, Any], sizes: Mapping[str, int | None]):
    plain: dict[str, None] = {}  # insertion-ordered set
    added: dict[str, Any] = {}
    for model_id, tokenizer in tokenizers.items():
        size = sizes[model_id] or tokenizer.vocab_size
        ordered = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        plain.update((token, None) for token, index in ordered if index < size)
        for index, info in sorted(tokenizer.added_tokens_decoder.items()):
            if index < size and info.content not in added:
                added[info.content] = info
    out = _copy(base)
    base_vocab = base.get_vocab()
    for token in plain:
        if token not in added and token not in base_vocab:
            out.add_tokens(token)
    for info in added.values():
        out.add_tokens(info)
    return out


def build_vocabulary(
    settings: TokenizerSettings, base_id: str, model_ids: list[str], folders: Mapping[str, Path]
) -> OutputVocabulary:
    """``folders``: model id -> its folder (a LoRA input's base folder), for every input and the source model."""
    sizes = {m: config_vocab_size(folders[m]) for m in model_ids}
    base = load_tokenizer(folders[base_id], base_id)
    if base is None:
        raise _refuse(f"the base {base_id!r} has no tokenizer that loads (tokenizer.json or tokenizer.model)")
    base = _strip(base, sizes.get(base_id) or config_vocab_size(folders[base_id]), base_id)
    tokenizers = {base_id: base}
    for model_id in model_ids:
        if model_id != base_id:
            loaded = load_tokenizer(folders[model_id], model_id)
            if loaded is not None:
                tokenizers[model_id] = loaded
    if settings.source == BASE:
        out = base
    elif settings.source == UNION:
        out = _union(base_id, base, tokenizers, sizes)
    else:
        source = str(settings.source)
        out = load_tokenizer(folders[source], source)
        if out is None:
            raise _refuse(f"tokenizer_source {source!r} has no tokenizer that loads", model=source)
    present = set(out.get_vocab())
    for token in settings.tokens:
        if token not in present:
            out.add_tokens(token)
            present.add(token)
    vocab = out.get_vocab()
    result = OutputVocabulary(
        tokenizer=out,
        vocab=vocab,
        rows=settings.padded(len(vocab)),
        original={m: t.get_vocab() for m, t in tokenizers.items()},
        base_id=base_id,
    )
    for model_id in model_ids:
        own = result.original.get(model_id, result.original[base_id])
        size = sizes[model_id] or len(own)
        result.token_ids[model_id] = {t: own[t] for t in vocab if t in own and own[t] < size}
        result.beyond[model_id] = {t: own[t] for t in vocab if t in own and own[t] >= size}
    return result
