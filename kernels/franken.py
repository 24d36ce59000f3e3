"""Franken merge (mergekit's passthrough) name rules: which tensors are embeddings, and a layer tensor's name at a
new index. The layer-stacking plan itself is :mod:`alloy.merge.plan`."""

from __future__ import annotations

import re

from kernels.params import layer_index

_EMBEDDING_MARKERS = ("embed", "wte", "wpe", "embeddings")


def is_embedding(tensor_name: str) -> bool:
    return any(marker in tensor_name for marker in _EMBEDDING_MARKERS)


def renumber(tensor_name: str, new_index: int) -> str:
    """``model.layers.7.mlp.up_proj.weight`` -> ``model.layers.<new_index>.mlp.up_proj.weight``."""
    old = layer_index(tensor_name)
    pattern = re.compile(rf"(^|\.)(layers|layer|h|blocks|block)\.{old}\.")
    return pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}.{new_index}.", tensor_name, count=1)
