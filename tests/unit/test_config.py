"""Configuration: YAML file, ALLOY_* overrides, field-naming errors, versioned reload."""

from __future__ import annotations

import pytest

from alloy.config import ConfigHolder, load_settings
from alloy.errors import AlloyError, ErrorCode


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "alloy.yaml"
    monkeypatch.setenv("ALLOY_CONFIG", str(path))
    for key in [k for k in __import__("os").environ if k.startswith("ALLOY_") and k != "ALLOY_CONFIG"]:
        monkeypatch.delenv(key)
    return path


def test_defaults_are_the_embedded_profile(config_file, tmp_path):
    settings = load_settings(data_dir=tmp_path / "var")
    assert settings.database_url == f"sqlite:///{(tmp_path / 'var' / 'alloy.db').resolve()}"
    assert settings.artifacts_uri == str((tmp_path / "var" / "artifacts").resolve())
    assert settings.rate_limits.read == "100/minute"
    assert settings.rate_limits.jobs == "10/minute"
    assert settings.lifecycle.shutdown_timeout_s == 300


def test_yaml_then_environment_override(config_file, monkeypatch):
    config_file.write_text("merge:\n  max_in_flight: 3\nserver:\n  public_url: https://alloy.example\n")
    assert load_settings().merge.max_in_flight == 3
    monkeypatch.setenv("ALLOY_MERGE__MAX_IN_FLIGHT", "7")
    settings = load_settings()
    assert settings.merge.max_in_flight == 7
    assert settings.server.public_url == "https://alloy.example"


def test_invalid_value_names_the_field(config_file):
    config_file.write_text("merge:\n  max_in_flight: 0\n")
    with pytest.raises(AlloyError) as caught:
        load_settings()
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    assert caught.value.details["field"] == "merge.max_in_flight"
    assert "merge.max_in_flight" in caught.value.message


def test_unknown_key_is_refused(config_file):
    config_file.write_text("mergee: {}\n")
    with pytest.raises(AlloyError) as caught:
        load_settings()
    assert caught.value.details["field"] == "mergee"


def test_s3_storage_options(config_file):
    config_file.write_text(
        "artifacts:\n  uri: s3://bucket/prefix\n  s3:\n    endpoint_url: http://127.0.0.1:9\n"
        "    access_key_id: a\n    secret_access_key: b\n"
    )
    settings = load_settings()
    assert settings.artifacts_uri == "s3://bucket/prefix"
    assert settings.storage_options == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "key": "a",
        "secret": "b",
    }


def test_reload_increments_version_and_keeps_old_on_error(config_file):
    config_file.write_text("merge:\n  max_in_flight: 2\n")
    holder = ConfigHolder()
    assert holder.version == 1
    config_file.write_text("merge:\n  max_in_flight: 5\n")
    assert holder.reload() == 2
    assert holder.settings.merge.max_in_flight == 5
    config_file.write_text("merge:\n  max_in_flight: -1\n")
    with pytest.raises(AlloyError):
        holder.reload()
    assert holder.version == 2
    assert holder.settings.merge.max_in_flight == 5


def test_vault_source_is_used_when_enabled(config_file, monkeypatch):
    """Vault KV v2 over real HTTP: a loopback server speaking the KV v2 read API."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            seen["path"], seen["token"] = self.path, self.headers.get("X-Vault-Token")
            body = json.dumps({"data": {"data": {"merge": {"max_in_flight": 9}}, "metadata": {"version": 1}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config_file.write_text(
            f"vault:\n  enabled: true\n  url: http://127.0.0.1:{server.server_port}\n  token: t0k\n  path: alloy/prod\n"
        )
        assert load_settings().merge.max_in_flight == 9
        assert seen == {"path": "/v1/secret/data/alloy/prod", "token": "t0k"}
    finally:
        server.shutdown()
