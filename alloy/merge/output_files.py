"""Everything in the merged folder besides the weights: config, tokenizer and generation files from the base (or
the tokenizer the merge built, :mod:`alloy.merge.tokenizer_merge`), and a model card that records the recipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from alloy.merge.plan import MergePlan, output_config
from alloy.merge.tokenizer_merge import TOKENIZER_FILES, TokenizerWork

# Files copied verbatim from the base model (tokenizer and generation settings).
BASE_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "generation_config.json",
    "chat_template.*",
    "preprocessor_config.json",
)


def write_config(
    plan: MergePlan, base_dir: Path, out_dir: Path, tokenizer: TokenizerWork | None = None
) -> dict[str, Any]:
    base_config = json.loads((base_dir / "config.json").read_text())
    config = output_config(plan, base_config)
    if tokenizer is not None:
        config = tokenizer.config(config)  # vocab_size: the output vocabulary's rows
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def copy_base_files(base_dir: Path, out_dir: Path, *, with_tokenizer: bool = True) -> list[str]:
    """The base's tokenizer and generation files; ``with_tokenizer=False``: not its tokenizer files (the merge
    writes its own tokenizer)."""
    copied = []
    patterns = BASE_FILE_PATTERNS if with_tokenizer else [p for p in BASE_FILE_PATTERNS if p not in TOKENIZER_FILES]
    for pattern in patterns:
        for path in sorted(base_dir.glob(pattern)):
            if path.is_file() and not (out_dir / path.name).exists():
                shutil.copy2(path, out_dir / path.name)
                copied.append(path.name)
    return copied


def recipe_yaml(plan: MergePlan) -> str:
    """The recipe as the user wrote it when it was mergekit YAML, else the validated Alloy recipe."""
    if plan.recipe.mergekit_config is not None:
        return plan.recipe.mergekit_config.strip() + "\n"
    data = plan.recipe.model_dump(mode="json", exclude_none=True, exclude={"mergekit_config"})
    return yaml.safe_dump(data, sort_keys=False)


def write_recipe_files(plan: MergePlan, out_dir: Path) -> None:
    """``mergekit_config.yml`` (as mergekit writes it) when the recipe came from mergekit YAML, verbatim."""
    if plan.recipe.mergekit_config is not None:
        (out_dir / "mergekit_config.yml").write_text(plan.recipe.mergekit_config)


def card_metadata(plan: MergePlan) -> dict[str, Any]:
    """The model card's front matter: the models merged (base first), tags, the method and its family."""
    models = [plan.base_id] + [m for m in plan.model_ids if m != plan.base_id]
    return {
        "base_model": models,
        "tags": ["merge", "alloy"],
        "merge_method": plan.method.name,
        "merge_strategy": plan.recipe.strategy,
        "library_name": "transformers",
    }


def write_model_card(plan: MergePlan, out_dir: Path) -> None:
    models = ", ".join(f"`{m}`" for m in plan.model_ids)
    card = (
        "---\n"
        f"{yaml.safe_dump(card_metadata(plan), sort_keys=False)}"
        "---\n\n"
        f"# Merged model\n\n"
        f"Made with Alloy: `{plan.method.name}` ({plan.recipe.strategy} family) of {models} "
        f"(base: `{plan.base_id}`).\n\n"
        "## Recipe\n\n"
        "```yaml\n"
        f"{recipe_yaml(plan)}"
        "```\n\n"
        "Reproduce with `alloy merge recipe.yml OUT_DIR` (same seed, same bits).\n"
    )
    (out_dir / "README.md").write_text(card)
