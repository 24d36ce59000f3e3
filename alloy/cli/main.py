"""The ``alloy`` command. Each subcommand lives in its own module and is imported only when used, so that
``alloy merge`` never pays for Ray and ``alloy key list`` never pays for torch."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import click

# command name -> "module:attribute" of a click command or group
SUBCOMMANDS: dict[str, str] = {
    "merge": "alloy.cli.merge:merge",
    "methods": "alloy.cli.merge:methods",
    "db": "alloy.cli.db:db",
    "zoo": "alloy.cli.zoo:zoo",
    "key": "alloy.cli.keys:key",
    "key-rotate": "alloy.cli.keys:key_rotate",
    "start": "alloy.cli.ops:start",
    "stop": "alloy.cli.ops:stop",
    "status": "alloy.cli.ops:status",
    "submit": "alloy.cli.submit:submit",
    "evaluate": "alloy.cli.evaluate:evaluate",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=LazyGroup)
@click.version_option(package_name="alloy-merge")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Data dir (database, artifacts) [default: $ALLOY_DATA_DIR, else data_dir of the config, "
    "relative to the project]",
)
def cli(data_dir: Path | None) -> None:
    """Alloy: merge, evaluate and evolve transformer checkpoints."""
    if data_dir is not None:  # every subcommand reads settings, which read ALLOY_DATA_DIR
        os.environ["ALLOY_DATA_DIR"] = str(data_dir.resolve())


if __name__ == "__main__":
    cli()
