"""`alloy --help` lists every subcommand from one table, without importing them (no torch, no Ray)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from alloy.cli.main import SUBCOMMANDS


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_listed_summary_is_the_commands_own_help(name):
    module_name, attribute = SUBCOMMANDS[name].target.split(":")
    command = getattr(importlib.import_module(module_name), attribute)
    assert command.get_short_help_str(limit=1000) == SUBCOMMANDS[name].summary


def test_top_level_help_lists_every_command_without_importing_torch_or_ray():
    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from alloy.cli.main import cli\n"
        "result = CliRunner().invoke(cli, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(result.output)\n"
        "print('heavy:', sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "heavy: []" in out
    for name in SUBCOMMANDS:
        assert f"  {name} " in out
