"""Deploying the Serve application from its config file, the way ``serve run config.yaml`` does, and waiting
until it answers. The caller is a connected Ray driver (``ray.init(address=...)``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from alloy.control import ray_private
from alloy.errors import AlloyError, ErrorCode


def load_serve_config(
    path: str | Path, *, app_args: dict[str, Any] | None = None, http_port: int | None = None
) -> ServeDeploySchema:
    """Read a Serve config file (``configs/serve.yaml``) into Ray's own schema, with the first application's
    builder args updated by ``app_args`` and the proxy port set to ``http_port``."""
    raw = yaml.safe_load(Path(path).read_text())
    if app_args:
        application = raw["applications"][0]
        application["args"] = {**(application.get("args") or {}), **app_args}
    if http_port is not None:
        raw.setdefault("http_options", {})
        raw["http_options"].update({"host": "127.0.0.1", "port": http_port})
    return ServeDeploySchema.model_validate(raw)


def deploy_serve_config(config: ServeDeploySchema, *, timeout_s: float = 300.0) -> None:
    """Deploy a ServeDeploySchema the way ``serve run config.yaml`` does (start Serve, then apply the config on
    the controller) and wait until every application is RUNNING. The caller must be connected (``ray.init``)."""
    client = ray_private.start_serve_client(config.http_options.model_dump())
    client.deploy_apps(config, _blocking=False)
    names = [app.name for app in config.applications]
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        status = serve.status()
        states = {name: status.applications.get(name) for name in names}
        last = {name: (s.status if s else None) for name, s in states.items()}
        if all(s is not None and s.status == "RUNNING" for s in states.values()):
            return
        failed = [s for s in states.values() if s is not None and s.status in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"serve deploy failed: {failed[0].message}")
        time.sleep(1.0)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"serve apps not RUNNING after {timeout_s:.0f}s: {last}")


def wait_http_ready(url: str, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5.0).status_code < 500:
                return
        except httpx.HTTPError as exc:
            error = exc
        time.sleep(0.5)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"{url} did not answer in {timeout_s:.0f}s: {error}")
