"""The ``alloy`` command. Each subcommand lives in its own module and is imported only when used, so that
``alloy merge`` never pays for Ray and ``alloy key list`` never pays for torch."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import NamedTuple

import click


class Subcommand(NamedTuple):
    target: str  # "module:attribute" of a click command or group
    summary: str  # what `alloy --help` lists, without importing the module (kept equal to its help by a test)


SUBCOMMANDS: dict[str, Subcommand] = {
    "merge": Subcommand(
        "alloy.cli.merge:merge",
        "Merge the models of RECIPE_FILE (Alloy or mergekit YAML) into the new folder OUT_DIR; with --dry-run (no "
        "OUT_DIR needed), print the resolved plan, the compatibility verdict and the estimated peak memory, disk and "
        "wall time instead.",
    ),
    "methods": Subcommand(
        "alloy.cli.merge:methods",
        "Every merge method (mergekit's names) with its family, parameters, ranges and defaults.",
    ),
    "db": Subcommand("alloy.cli.db:db", "Database schema migrations (Alembic, shipped inside Alloy)."),
    "zoo": Subcommand(
        "alloy.cli.zoo:zoo",
        "Offline benchmark zoo: pretrained models, fine-tunes and evaluation datasets built on this machine.",
    ),
    "key": Subcommand("alloy.cli.keys:key", "Manage API keys (create, list, revoke)."),
    "key-rotate": Subcommand(
        "alloy.cli.keys:key_rotate",
        "Issue a new key (new key ID) replacing KEY_ID; the old key stops working after the grace period.",
    ),
    "start": Subcommand(
        "alloy.cli.ops:start",
        "Start a local Ray cluster and the Alloy app (cold, or --warm); stays in the foreground until stopped "
        "(`alloy stop`, SIGTERM or Ctrl-C).",
    ),
    "stop": Subcommand(
        "alloy.cli.ops:stop",
        "Stop the cluster started by ``alloy start``: graceful (drain active jobs, flush, close, terminate) or "
        "--force.",
    ),
    "status": Subcommand(
        "alloy.cli.ops:status",
        "Show the persisted cluster state: state, config version, pools, last start and stop (each step with its "
        "duration), the last recovery, active jobs.",
    ),
    "submit": Subcommand("alloy.cli.submit:submit", "Submit jobs to a running Alloy service."),
    "evaluate": Subcommand(
        "alloy.cli.evaluate:evaluate",
        "Score MODEL_DIR on datasets of a built zoo preset and print one line per metric.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        sub = SUBCOMMANDS.get(name)
        if sub is None:
            return None
        module_name, attribute = sub.target.split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing imports every subcommand for its help line (the client and its wire models pull in
        # torch): `alloy --help` would cost seconds of CPU. The summaries are listed from the table instead.
        width = formatter.width - 6 - max(len(name) for name in SUBCOMMANDS)
        rows = [
            (name, click.Command(name, help=sub.summary).get_short_help_str(width)) for name, sub in SUBCOMMANDS.items()
        ]
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


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
