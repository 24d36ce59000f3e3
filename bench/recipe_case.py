"""One recipe of the mergekit differential bench and conformance tests, and what is expected of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    recipe: str  # mergekit YAML; {base} {a} {b} {c} are model paths
    random: bool = False
    origin: str = "alloy"  # where the configuration comes from
    refused: str | None = None  # the key Alloy refuses, named in details.field
    ignored: tuple[str, ...] = ()  # keys mergekit accepts and the method never reads: Alloy merges and warns
    known_difference: str | None = None  # why the tensors are expected to differ (reported, not hidden)
    trimmed: tuple[str, ...] = ()  # models a TIES-style top-k trims at ``density``: ties at its threshold may differ
    density: float | None = 1.0  # None: per tensor, as the recipe's gradients and filters give it
    selection: str = "magnitude"  # or "variance" (SCE's top-k)

    def text(self, models: dict[str, Path]) -> str:
        return self.recipe.format(**{k: str(v) for k, v in models.items()})
