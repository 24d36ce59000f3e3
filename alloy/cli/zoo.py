"""``alloy zoo``: build the offline benchmark presets (cached under ``<data_dir>/zoo/<preset>``) and register them."""

from __future__ import annotations

import logging
from pathlib import Path

import click


def _data_dir(value: str | None) -> Path:
    if value:
        return Path(value)
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.config import load_settings

    return Path(load_settings().data_dir)


@click.group()
def zoo() -> None:
    """Offline benchmark zoo: pretrained models, fine-tunes and evaluation datasets built on this machine."""


@zoo.command("list")
@click.option("--data-dir", default=None, help="Alloy data dir (default: the configured data_dir).")
def list_presets(data_dir: str | None) -> None:
    """The presets, and which are built."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.zoo.manifest import built_preset
    from alloy.zoo.presets import PRESETS, preset_root

    root = _data_dir(data_dir)
    for name, (_, description) in PRESETS.items():
        manifest = built_preset(preset_root(name, root))
        state = (
            f"built ({manifest.build_seconds:.0f}s, {len(manifest.models)} models, {len(manifest.datasets)} datasets)"
            if manifest
            else "not built"
        )
        click.echo(f"{name:14s} {state:50s} {description}")


@zoo.command("build")
@click.argument("preset")
@click.option("--data-dir", default=None, help="Alloy data dir (default: the configured data_dir).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--force", is_flag=True, help="Rebuild even if a finished build exists.")
@click.option("--register", is_flag=True, help="Register the models and datasets in the configured registries.")
@click.option("--threads", default=1, show_default=True, type=int, help="torch CPU threads.")
def build(preset: str, data_dir: str | None, seed: int, force: bool, register: bool, threads: int) -> None:
    """Build PRESET (tiny, encoder-5task, causal-lm); a finished build is reused."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    import torch

    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.errors import AlloyError
    from alloy.zoo.presets import build_preset, quiet_build_output

    quiet_build_output()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(threads)
    try:
        manifest = build_preset(preset, _data_dir(data_dir), seed=seed, force=force)
    except AlloyError as exc:
        raise click.ClickException(exc.message) from None
    click.echo(f"{manifest.preset}: {manifest.root} (built in {manifest.build_seconds:.0f}s)")
    for model in manifest.models:
        click.echo(f"  model   {model.model_id:28s} {model.role:9s} {model.path}")
    for dataset in manifest.datasets:
        click.echo(f"  dataset {dataset.dataset_id:28s} {dataset.task['type']:15s} splits={','.join(dataset.splits)}")
    if register:
        _register(manifest)


def _register(manifest) -> None:
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.config import load_settings
    from alloy.registry.datasets import DatasetRegistry
    from alloy.registry.models import ModelRegistry
    from alloy.storage.artifacts import ArtifactStore
    from alloy.storage.db import Database
    from alloy.zoo.presets import register_preset

    settings = load_settings()
    database = Database.from_settings(settings)
    try:
        database.verify_schema()
        store = ArtifactStore.from_settings(settings)
        models = ModelRegistry.from_settings(settings, database, store)
        datasets = DatasetRegistry(database, store)
        done = register_preset(manifest, models, datasets, store=store)
    finally:
        database.close()
    click.echo(
        f"registered {len(done['models'])} models and {len(done['datasets'])} datasets "
        "(already registered ones left as they were)"
    )
