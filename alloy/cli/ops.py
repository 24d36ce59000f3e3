"""``alloy start`` / ``alloy stop`` / ``alloy status``: a local Ray cluster running the app.

The orchestration is in :mod:`alloy.control.local_run` (the Ray head, the start sequence, the shutdown); the state is
the persisted cluster state of :mod:`alloy.cluster.state`, which ``alloy status`` reads from the database.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import click

from alloy.errors import AlloyError

EXIT_ESCALATED = 2  # a graceful stop that ran past its timeout and was forced
EXIT_NOT_RUNNING = 3  # `alloy status` of a cluster that is not READY (LSB "program is not running")
EXIT_DEAD = 1  # `alloy status` of a cluster whose `alloy start` died (LSB "dead and the pid file exists")
STOP_GRACE_S = 120.0  # how much longer than the drain timeout `alloy stop` waits for flush and terminate


def _show_lifecycle_steps() -> None:
    """Print each start/stop step as it finishes (the step runner logs them on ``alloy.lifecycle``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("  %(message)s"))
    logger = logging.getLogger("alloy.lifecycle")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _echo_run(title: str, run) -> None:
    if run is None:
        click.echo(f"{title}: none recorded")
        return
    outcome = "ok" if run.ok else "FAILED" if run.mode in ("cold", "warm") else "unclean"
    when = run.finished_at.isoformat(timespec="seconds") if run.finished_at else "unfinished"
    click.echo(f"{title}: {run.mode}, {outcome}, {run.total_s:.1f}s, {when}")
    for step in run.steps:
        detail = f"  {step.detail}" if step.detail else ""
        click.echo(f"  {step.name:<40} {step.status:<8} {step.duration_s:8.3f}s{detail}")
    if run.error:
        click.echo(f"  error: {run.error}")


class _Signals:
    """What the foreground `alloy start` was asked: stop (SIGTERM, Ctrl-C; a second one forces) or reload
    (SIGHUP). The handlers only set flags; the main loop acts on them."""

    def __init__(self) -> None:
        self.stop = False
        self.force = False
        self.reload = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)

    def _on_stop(self, *_) -> None:
        if self.stop:
            self.force = True  # asked twice: do not wait any longer
        self.stop = True

    def _on_reload(self, *_) -> None:
        self.reload = True


@click.command()
@click.option("--demo/--no-demo", default=False, help="Build the offline demo zoo and register it")
@click.option("--warm", is_flag=True, help="Warm start: restore the worker pools saved at the last stop")
@click.option(
    "--skip-dependency-checks",
    is_flag=True,
    help="With --warm: skip dependency validation (the operator confirms they are healthy)",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Alloy config file (default: ALLOY_CONFIG or configs/alloy.yaml)",
)
@click.option(
    "--serve-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="Serve config file (default: configs/serve.yaml)",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="HTTP port (default: server.port in the config, 8470, when free); refused when busy",
)
def start(
    demo: bool,
    warm: bool,
    skip_dependency_checks: bool,
    config_path: str | None,
    serve_config: str | None,
    port: int | None,
) -> None:
    """Start a local Ray cluster and the Alloy app (cold, or --warm); stays in the foreground until stopped
    (`alloy stop`, SIGTERM or Ctrl-C). SIGHUP reloads the configuration."""
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.control.local_run import reload_local, start_local

    if skip_dependency_checks and not warm:
        raise click.UsageError("--skip-dependency-checks applies to a warm start only (add --warm)")
    _show_lifecycle_steps()
    click.echo(f"{'warm' if warm else 'cold'} start:", err=True)
    try:
        run = start_local(
            config_path=config_path,
            demo=demo,
            serve_config=serve_config,
            warm=warm,
            skip_dependency_checks=skip_dependency_checks,
            echo=lambda m: click.echo(m, err=True),
            port=port,
        )
    except AlloyError as exc:
        raise click.ClickException(f"{exc.code.value}: {exc.message}") from None
    click.echo(
        f"\nAlloy is READY in {run.start.total_s:.1f}s: {run.url}  "
        f"(API docs: {run.url}/docs, Ray dashboard: {run.head.dashboard_url})"
    )
    if run.admin_key:  # a new key: shown this once (the first start)
        click.echo(f"admin API key: {run.admin_key}")
        click.echo(f"  export ALLOY_URL={run.url} ALLOY_API_KEY={run.admin_key}")
    elif run.admin_key_file is not None:
        click.echo(f"admin API key: as shown at the first start (also in {run.admin_key_file}, mode 0600)")
        click.echo(f"  export ALLOY_URL={run.url} ALLOY_API_KEY=$(cat {run.admin_key_file})")
    if run.registered.get("models"):
        click.echo(f"demo models: {', '.join(run.registered['models'])}")
    click.echo("`alloy stop` (or Ctrl-C) stops it; `alloy status` shows the cluster state.", err=True)

    signals = _Signals()
    signals.install()
    head = run.head.process
    assert head is not None  # a head this command started has its process
    while not signals.stop and head.poll() is None:
        if signals.reload:
            signals.reload = False
            _reload(run, reload_local)
        time.sleep(0.5)
    sys.exit(_stop(run, signals))


def _reload(run, reload_local) -> None:
    click.echo("SIGHUP: reloading the configuration (warm start) ...", err=True)
    try:
        result = reload_local(run)
    except Exception as exc:  # noqa: BLE001 - an invalid configuration keeps the running one
        message = exc.message if isinstance(exc, AlloyError) else f"{type(exc).__name__}: {exc}"
        click.echo(f"reload refused, configuration version {run.context['config'].version} kept: {message}", err=True)
        return
    click.echo(
        f"reloaded: READY in {result.total_s:.1f}s, configuration version {run.context['config'].version}", err=True
    )


def _stop(run, signals: _Signals) -> int:
    # lazy: a command imports only what it runs (`alloy stop` never loads Ray, `alloy key` never torch)
    from alloy.cluster.local_state import StopRequest, take_stop_request
    from alloy.control.local_run import stop_local

    if run.head.process.poll() is not None:
        click.echo("the Ray head exited on its own: forced stop", err=True)
        request = StopRequest(force=True)
    else:
        request = take_stop_request(run.data_dir)
        request.force = request.force or signals.force
    click.echo(f"stopping ({'forced' if request.force else 'graceful'}) ...", err=True)
    report = stop_local(run, request, force_requested=lambda: signals.force)
    click.echo(f"STOPPED ({report.run.mode}) in {report.run.total_s:.1f}s.", err=True)
    return EXIT_ESCALATED if report.escalated else 0


@click.command()
@click.option("--force", is_flag=True, help="Cancel active jobs at once instead of waiting for them")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds to wait for active merges and evaluations before forcing "
    "(default: lifecycle.shutdown_timeout_s, 300)",
)
def stop(force: bool, timeout_s: float | None) -> None:
    """Stop the cluster started by ``alloy start``: graceful (drain active jobs, flush, close, terminate) or
    --force. Exits 2 when a graceful stop ran past its timeout and was forced."""

    from alloy.cli.data import cli_settings
    from alloy.cluster.local_state import StopRequest, pid_alive, read_local_state, write_stop_request

    settings = cli_settings()
    data_dir = settings.data_dir
    local = read_local_state(data_dir)
    if local is None or not pid_alive(local.get("pid")):
        status = _cluster_status(settings)
        raise click.ClickException(
            f"no running `alloy start` for data dir {data_dir} (cluster state: {status.state.value})"
        )
    limit = (timeout_s if timeout_s is not None else settings.lifecycle.shutdown_timeout_s) + STOP_GRACE_S
    write_stop_request(data_dir, StopRequest(force=force, timeout_s=timeout_s))
    os.kill(local["pid"], signal.SIGTERM)
    click.echo(f"stopping `alloy start` (pid {local['pid']}, {'forced' if force else 'graceful'}) ...", err=True)
    waited_s = STOP_GRACE_S if force else limit
    deadline = time.monotonic() + waited_s
    while pid_alive(local["pid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    if pid_alive(local["pid"]):
        raise click.ClickException(
            f"`alloy start` (pid {local['pid']}) is still stopping after {waited_s:.0f}s; "
            "`alloy stop --force` forces it"
        )
    status = _cluster_status(settings)
    click.echo(f"cluster: {status.state.value}")
    _echo_run("stop", status.last_stop)
    if status.last_stop is not None and status.last_stop.mode == "graceful->forced":
        sys.exit(EXIT_ESCALATED)


def _cluster_status(settings):
    from alloy.cli.data import open_existing_database
    from alloy.cluster.state import ClusterStateStore

    db = open_existing_database(settings)
    try:
        return ClusterStateStore(db).get()
    finally:
        db.close()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the persisted cluster status as JSON")
def status(as_json: bool) -> None:
    """Show the persisted cluster state: state, config version, pools, last start and stop (each step with
    its duration), the last recovery, active jobs. Reads only the database. Exits 0 when READY and its `alloy
    start` is alive, 1 when the cluster died (its state is not STOPPED but no `alloy start` is alive), 3
    otherwise."""

    from alloy.cli.data import cli_settings, open_existing_database
    from alloy.cluster.local_state import pid_alive, read_local_state
    from alloy.cluster.state import ClusterState, ClusterStateStore
    from alloy.jobs.store import JobStore

    settings = cli_settings()
    db = open_existing_database(settings)
    try:
        cluster = ClusterStateStore(db).get()
        active = JobStore(db).active()
    finally:
        db.close()
    local = read_local_state(settings.data_dir)
    running = local is not None and pid_alive(local.get("pid"))
    dead = None if running or cluster.state is ClusterState.STOPPED else _death_notice(cluster.state.value, local)
    if as_json:
        body = cluster.model_dump(mode="json", exclude={"snapshot"})
        body.update(
            active_jobs=len(active),
            url=local["url"] if local and running else None,
            pid=local["pid"] if local and running else None,
            alive=running,
            problem=dead,
        )
        click.echo(json.dumps(body, indent=2))
    else:
        _echo_status(cluster, active, local if running else None)
    if dead is not None:
        click.echo(f"Error: {dead}", err=True)
        sys.exit(EXIT_DEAD)
    if cluster.state is not ClusterState.READY:
        sys.exit(EXIT_NOT_RUNNING)


def _death_notice(state: str, local) -> str:
    """The one line of a cluster that died without stopping (kill -9, power loss, OOM killer)."""
    process = f"`alloy start` (pid {local['pid']}) is gone" if local else "no `alloy start` process is alive"
    return (
        f"the cluster is dead: its state is {state} but {process}; its jobs are not running. "
        "`alloy start` recovers it (consistency check, replay of interrupted jobs)"
    )


def _echo_status(cluster, active, local) -> None:
    click.echo(f"cluster: {cluster.state.value}   config version: {cluster.config_version}")
    if local is not None:
        click.echo(f"running: {local['url']} (pid {local['pid']}, ray {local['address']})")
    elif cluster.state.value != "STOPPED":
        click.echo(
            "no `alloy start` process is alive: the last run ended uncleanly; the next start checks "
            "consistency and replays interrupted jobs"
        )
    pools = ", ".join(f"{name} x{count}" for name, count in sorted(cluster.pools.items())) or "none saved"
    click.echo(f"pools: {pools}")
    _echo_run("last start", cluster.last_start)
    _echo_run("last stop", cluster.last_stop)
    if cluster.recovery:
        click.echo(f"last recovery: {cluster.recovery.get('summary')}; repaired: {cluster.recovery.get('repair')}")
        for broken in cluster.recovery.get("broken_records") or []:
            click.echo(f"  broken {broken['registry']}/{broken['id']}: {broken['reason']}")
    by_state: dict[str, int] = {}
    for job in active:
        by_state[job.state.value] = by_state.get(job.state.value, 0) + 1
    detail = ", ".join(f"{count} {state}" for state, count in sorted(by_state.items()))
    click.echo(f"active jobs: {len(active)}{f' ({detail})' if detail else ''}")
