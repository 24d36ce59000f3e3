"""A merge's tokenizer work, prepared before any tensor is read and written after the tensors: the output
vocabulary and its row planner (``tokenizer_source`` / ``tokenizer:``), the chat template, the tokenizer files
and the rewritten ``vocab_size``.

Without tokenizer settings the output takes the base's tokenizer files as they are. With a vocabulary, the output
carries the built tokenizer (saved by ``transformers``, so ``AutoTokenizer.from_pretrained(out)`` loads it) and
``vocab_size`` is its size padded to ``pad_to_multiple_of``, the embedding rows. With only ``chat_template``, the
base's tokenizer is saved again with the template (as mergekit does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode, model_not_found
from alloy.merge.chat_templates import check_chat_template, resolve_chat_template
from alloy.merge.recipe import MergeRecipe
from alloy.merge.tokenizer import OutputVocabulary, build_vocabulary, load_tokenizer
from alloy.merge.tokenizer_rows import RowPlanner

# Files of the base's tokenizer that a written tokenizer replaces (never copied next to it).
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "chat_template.*",
)


@dataclass
class TokenizerWork:
    tokenizer: Any  # the tokenizer to save into the output
    chat_template: str | None
    vocabulary: OutputVocabulary | None
    rows: RowPlanner | None

    def write(self, out_dir: Path) -> None:
        if self.chat_template is not None:
            self.tokenizer.chat_template = self.chat_template
        self.tokenizer.save_pretrained(str(out_dir))

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The output config with ``vocab_size`` (where the base's config keeps it) set to the embedding rows."""
        if self.vocabulary is None:
            return config
        config = dict(config)
        text = config.get("text_config")
        if "vocab_size" not in config and isinstance(text, dict) and "vocab_size" in text:
            config["text_config"] = {**text, "vocab_size": self.vocabulary.rows}
        else:
            config["vocab_size"] = self.vocabulary.rows
        return config


def tokenizer_base(recipe: MergeRecipe) -> str:
    """The model whose tokenizer is the starting point: ``base_model``, else the first model (mergekit)."""
    return recipe.base_model or recipe.model_ids[0]


def mergekit_order(recipe: MergeRecipe) -> list[str]:
    """The inputs in mergekit's order for a ``models:`` recipe (the base last when it is not listed); a sliced
    recipe's inputs are already in its sources' order."""
    if recipe.slices:
        return []
    listed = [m.model for m in recipe.models]
    return listed + ([recipe.base_model] if recipe.base_model and recipe.base_model not in listed else [])


def prepare_tokenizer(recipe: MergeRecipe, folders: Mapping[str, Path]) -> TokenizerWork | None:
    """``folders``: model id -> its folder (a LoRA input's base folder), for the inputs and any tokenizer source
    that is not an input. None: the recipe has no tokenizer settings."""
    settings = recipe.tokenizer
    if settings is None:
        return None
    if settings.chat_template is not None:
        check_chat_template(settings.chat_template)
    if settings.source_model is not None and settings.source_model not in folders:
        raise model_not_found(settings.source_model)
    base_id = tokenizer_base(recipe)
    vocabulary = rows = None
    if settings.builds_vocabulary:
        vocabulary = build_vocabulary(settings, base_id, recipe.model_ids, folders)
        rows = RowPlanner(vocabulary, settings, mergekit_order(recipe))
        tokenizer = vocabulary.tokenizer
    else:
        tokenizer = load_tokenizer(folders[base_id], base_id)
        if tokenizer is None:
            raise AlloyError(
                ErrorCode.VALIDATION_FAILED,
                f"chat_template: the base {base_id!r} has no tokenizer that loads to carry it",
                {"field": "chat_template"},
            )
    template = None
    if settings.chat_template is not None:
        templates = (_template_of(folders[m], m) for m in recipe.model_ids)
        template = resolve_chat_template(settings.chat_template, templates)
    return TokenizerWork(tokenizer, template, vocabulary, rows)


def _template_of(folder: Path, model_id: str) -> object:
    tokenizer = load_tokenizer(folder, model_id)
    return getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
