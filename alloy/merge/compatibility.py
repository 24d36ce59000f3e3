"""Can these models be merged? Decided from config and tensor layouts only, before any tensor is read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from alloy.errors import AlloyError, ErrorCode, model_not_found
from alloy.merge.plan import Layout
from alloy.merge.recipe import MergeRecipe


def incompatible(message: str, **details: Any) -> AlloyError:
    return AlloyError(ErrorCode.INCOMPATIBLE_MODELS, message, details)


def first_layout_mismatch(
    reference: Layout, other: Layout, free_rows: Callable[[str], bool] | None = None
) -> dict[str, Any] | None:
    """The first tensor (by name) missing from one layout or shaped differently, with both shapes; the rows of
    tensors ``free_rows`` names (vocabulary tensors that are aligned) are not compared."""
    for name in sorted(set(reference) | set(other)):
        mine, theirs = reference.get(name), other.get(name)
        skip = 1 if free_rows is not None and free_rows(name) else 0
        if mine is None or theirs is None or mine.shape[skip:] != theirs.shape[skip:]:
            return {
                "tensor": name,
                "shapes": [list(mine.shape) if mine else None, list(theirs.shape) if theirs else None],
            }
    return None


def check_layouts(
    recipe: MergeRecipe,
    layouts: Mapping[str, Layout],
    *,
    model_types: Mapping[str, Any] | None = None,
    hidden_sizes: Mapping[str, Any] | None = None,
) -> None:
    """INCOMPATIBLE_MODELS unless the models share architecture and tensor shapes (a sliced recipe: architecture
    and hidden size here; the shapes of the tensors merged together are checked when the plan pairs them).
    ``model_types``/``hidden_sizes`` come from config.json when known."""
    for model_id in recipe.model_ids:
        if model_id not in layouts:
            raise model_not_found(model_id)
    base = recipe.base
    model_types = model_types or {}
    for model_id in recipe.model_ids:
        if model_id == base:
            continue
        if model_types.get(base) != model_types.get(model_id):
            raise incompatible(
                f"{model_id!r} is a {model_types.get(model_id)} model but the base {base!r} is a {model_types.get(base)} model",
                models=[base, model_id],
                architectures=[model_types.get(base), model_types.get(model_id)],
            )
        if recipe.slices:
            sizes = hidden_sizes or {}
            if sizes.get(base) != sizes.get(model_id):
                raise incompatible(
                    f"sliced merges need one hidden size: {base!r} has {sizes.get(base)}, {model_id!r} has {sizes.get(model_id)}",
                    models=[base, model_id],
                    hidden_sizes=[sizes.get(base), sizes.get(model_id)],
                )
            continue
        mismatch = first_layout_mismatch(layouts[base], layouts[model_id], _aligned_rows(recipe))
        if mismatch is not None:
            shapes = mismatch["shapes"]
            raise incompatible(
                f"tensor {mismatch['tensor']!r} is {_describe(shapes[0])} in {base!r} but {_describe(shapes[1])} in {model_id!r}"
                + _vocabulary_hint(recipe, mismatch["tensor"], shapes),
                tensor=mismatch["tensor"],
                shapes=shapes,
                models=[base, model_id],
            )


def _aligned_rows(recipe: MergeRecipe) -> Callable[[str], bool] | None:
    """Vocabulary tensors may differ in rows when the recipe builds an output vocabulary (they are aligned)."""
    if recipe.tokenizer is None or not recipe.tokenizer.builds_vocabulary:
        return None
    from alloy.merge.tokenizer_rows import is_vocabulary_tensor

    return is_vocabulary_tensor


def _vocabulary_hint(recipe: MergeRecipe, tensor: str, shapes: list[Any]) -> str:
    """Embeddings that differ only in rows: the vocabularies differ, which tokenizer settings align."""
    from alloy.merge.tokenizer_rows import is_vocabulary_tensor

    if not (recipe.is_mergekit and is_vocabulary_tensor(tensor) and all(shapes)) or shapes[0][1:] != shapes[1][1:]:
        return ""
    return " (the vocabularies differ: set tokenizer_source or a tokenizer: block to align the embedding rows)"


def _describe(shape: list[int] | None) -> str:
    return "missing" if shape is None else f"shaped {shape}"


def check_compatibility(recipe: MergeRecipe, manifests: Mapping[str, Any]) -> None:
    """The contract's entry point: compatibility from :class:`alloy.model_manifest.ModelManifest` headers."""
    from alloy.merge.plan import layout_from_manifest

    for model_id in recipe.model_ids:
        if model_id not in manifests:
            raise model_not_found(model_id)
    ids = recipe.model_ids
    check_layouts(
        recipe,
        {m: layout_from_manifest(manifests[m]) for m in ids},
        model_types={m: manifests[m].model_type or manifests[m].architecture for m in ids},
        hidden_sizes={m: manifests[m].hidden_size for m in ids},
    )
