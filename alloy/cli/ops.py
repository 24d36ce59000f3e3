"""``alloy start`` / ``alloy stop`` / ``alloy status``: a local Ray cluster running the app (orchestration in
:mod:`alloy.lifecycle`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click

from alloy.errors import AlloyError


def _data_dir() -> Path:
    from alloy.config import load_settings

    return Path(load_settings().data_dir).resolve()


@click.command()
@click.option("--demo/--no-demo", default=False, help="Build the offline demo zoo and register it")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Alloy config file (default: ALLOY_CONFIG or configs/alloy.yaml)")
@click.option("--serve-config", type=click.Path(dir_okay=False), default=None,
              help="Serve config file (default: configs/serve.yaml)")
def start(demo: bool, config_path: str | None, serve_config: str | None) -> None:
    """Start a local Ray cluster and the Alloy app; stays in the foreground until Ctrl-C."""
    from alloy.lifecycle import start_local, stop_local_head

    try:
        run = start_local(config_path=config_path, demo=demo, serve_config=serve_config,
                          echo=lambda m: click.echo(m, err=True))
    except AlloyError as exc:
        raise click.ClickException(f"{exc.code.value}: {exc.message}") from None
    click.echo(f"\nAlloy is up: {run.url}  (API docs: {run.url}/docs, Ray dashboard: {run.head.dashboard_url})")
    if run.admin_key:
        click.echo(f"admin API key: {run.admin_key}")
        click.echo(f"  export ALLOY_URL={run.url} ALLOY_API_KEY={run.admin_key}")
    if run.registered.get("models"):
        click.echo(f"demo models: {', '.join(run.registered['models'])}")
    click.echo("Ctrl-C to stop.")

    stopping = {"flag": False}

    def _stop(*_):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping["flag"] and run.head.process.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    click.echo("stopping: draining the app and the Ray head ...", err=True)
    stop_local_head(run.head, data_dir=run.data_dir)
    click.echo("stopped.", err=True)


@click.command()
@click.option("--timeout", default=330.0, show_default=True, help="Seconds to wait for a graceful stop")
def stop(timeout: float) -> None:
    """Stop the cluster started by ``alloy start`` (graceful: running merges are drained)."""
    from alloy.lifecycle import pid_alive, read_local_state

    data_dir = _data_dir()
    state = read_local_state(data_dir)
    if state is None or not pid_alive(state.get("pid")):
        raise click.ClickException(f"no running `alloy start` found for data dir {data_dir}")
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(state["pid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    if pid_alive(state["pid"]):
        raise click.ClickException(f"`alloy start` (pid {state['pid']}) is still stopping after {timeout:.0f}s")
    click.echo("stopped.")


@click.command()
@click.option("--key", envvar="ALLOY_API_KEY", default=None, help="API key for /health (default: ALLOY_API_KEY)")
def status(key: str | None) -> None:
    """Show whether the local cluster runs and what /health says."""
    import httpx

    from alloy.lifecycle import DEMO_KEY_FILE, pid_alive, read_local_state

    data_dir = _data_dir()
    state = read_local_state(data_dir)
    if state is None or not pid_alive(state.get("pid")):
        click.echo("STOPPED")
        raise SystemExit(3)
    key_file = data_dir / DEMO_KEY_FILE
    key = key or (key_file.read_text().strip() if key_file.exists() else None)
    click.echo(f"running: {state['url']} (pid {state['pid']}, ray {state['address']})")
    try:
        response = httpx.get(f"{state['url']}/health", headers={"Authorization": f"Bearer {key}"} if key else {},
                             timeout=15)
    except httpx.HTTPError as exc:
        click.echo(f"health: unreachable ({exc})")
        raise SystemExit(1) from None
    body = response.json()
    if response.status_code != 200:
        click.echo(f"health: HTTP {response.status_code} {body.get('error', body)}")
        raise SystemExit(1)
    click.echo(f"cluster: {body['cluster_state']}  status: {body['status']}  config version: {body['config_version']}")
    for name, component in body["components"].items():
        click.echo(f"  {name:<18} {component['status']}")
