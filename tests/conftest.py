"""Session-wide fixtures. Component fixtures live in ``tests/fixtures/<name>.py`` (one file per owner) and are
loaded here as plugins when present: ``databases`` (SQLite + PostgreSQL), ``s3`` (moto server on loopback),
``ray_cluster`` (one real Ray cluster per session), ``service`` (the Serve app over real HTTP), ``multinode`` (a
head and worker nodes with PostgreSQL and S3, per module)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    f"tests.fixtures.{name}"
    for name in ("databases", "s3", "ray_cluster", "service", "multinode")
    if importlib.util.find_spec(f"tests.fixtures.{name}") is not None
]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch="llama", seed=0, **kwargs) -> Path``: tiny random HF models, built once per argument set."""
    from alloy.zoo.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **kwargs) -> Path:
        key = (arch, seed, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in built:
            built[key] = build_tiny_model(root / f"{arch}-{seed}-{len(built)}", arch, seed=seed, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_family(tiny_model_factory):
    """A base llama and three seeded fine-tunes of it (task vectors of scale 0.02)."""
    base = tiny_model_factory("llama", seed=0)
    tunes = [tiny_model_factory("llama", seed=s, base=base) for s in (1, 2, 3)]
    return base, tunes
