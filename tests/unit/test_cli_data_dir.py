"""The CLI from any folder: the data dir from --data-dir, ALLOY_DATA_DIR or the config (relative to the
project); read commands never create a database and say in one line what to do; the stable HTTP port."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from alloy.cli.main import cli
from alloy.errors import AlloyError, ErrorCode
from alloy.http_port import choose_http_port


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A folder outside the project, with no Alloy variables set."""
    for name in ("ALLOY_DATA_DIR", "ALLOY_CONFIG", "ALLOY_DATABASE__URL"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.parametrize("command", [["status"], ["stop"], ["key", "list"]])
def test_read_commands_without_data_say_so_in_one_line_and_create_nothing(elsewhere, command):
    missing = elsewhere / "no-data"
    result = CliRunner().invoke(cli, ["--data-dir", str(missing), *command])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no Alloy data in" in lines[0] and "alloy start" in lines[0]
    assert "Traceback" not in result.output and "sqlalchemy" not in result.output.lower()
    assert not missing.exists() and not (elsewhere / "var").exists()


def test_the_environment_names_the_data_dir_too(elsewhere, monkeypatch):
    monkeypatch.setenv("ALLOY_DATA_DIR", "rel-data")  # relative to where the user is
    result = CliRunner().invoke(cli, ["key", "list"])
    assert result.exit_code == 1 and str(elsewhere / "rel-data") in result.output
    assert not (elsewhere / "rel-data").exists()


def test_an_existing_data_dir_is_read_from_any_folder(elsewhere, tmp_path):
    from alloy.storage.db import Database

    data = tmp_path / "data"
    data.mkdir()
    db = Database(f"sqlite:///{data / 'alloy.db'}")
    db.upgrade()
    db.close()
    result = CliRunner().invoke(cli, ["--data-dir", str(data), "key", "list"])
    assert result.exit_code == 0, result.output


def test_without_flag_or_env_the_config_data_dir_is_relative_to_the_project(elsewhere):
    from alloy.cli.data import cli_settings
    from alloy.config import PROJECT_ROOT

    assert cli_settings().data_dir == (PROJECT_ROOT / "var").resolve()


def test_start_offers_a_port_option():
    result = CliRunner().invoke(cli, ["start", "--help"])
    assert result.exit_code == 0 and "--port" in result.output and "8470" in result.output


def _busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_choice():
    with _busy_port() as sock:
        busy = sock.getsockname()[1]
        with pytest.raises(AlloyError) as caught:
            choose_http_port(busy, 8470)
        assert caught.value.code is ErrorCode.CONFLICT
        assert choose_http_port(None, busy) is None  # the default falls back instead
    with pytest.raises(AlloyError) as caught:
        choose_http_port(8265, 8470)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    with _busy_port() as sock:
        free = sock.getsockname()[1]
    assert choose_http_port(None, free) == free
    assert choose_http_port(free, 8470) == free
