"""``alloy start`` / ``alloy stop`` / ``alloy status``: the local runner that owns a Ray head and the Serve app.

`alloy start` runs in the foreground: it owns the Ray driver and the head's process, so it is the process
that runs the start sequence (alloy.cluster.startup via alloy.control.serve_ops) and, when `alloy stop` signals it, the
shutdown (alloy.cluster.shutdown). The lifecycle state itself lives in the database (alloy.cluster.state); the files
below only tell `alloy stop` which process to signal and what it asked for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

from alloy.cluster.local_state import (
    PROJECT_ROOT,
    STATE_FILE,
    STOP_REQUEST_FILE,
    StopRequest,
    local_settings,
    pid_alive,
    read_local_state,
)
from alloy.cluster.shutdown import Shutdown, ShutdownActions, ShutdownReport
from alloy.cluster.startup import StartContext
from alloy.cluster.state import ClusterStateStore, LifecycleRun
from alloy.components import RAY_NAMESPACE
from alloy.config import ConfigHolder, Settings
from alloy.control import serve_ops
from alloy.control.ray_head import RayHead, start_ray_head, stop_ray_head
from alloy.control.sequences import serve_start_sequence
from alloy.control.serve_deploy import load_serve_config
from alloy.errors import AlloyError, ErrorCode
from alloy.http_port import choose_http_port
from alloy.jobs.store import JobStore
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database
from alloy.storage.keys import ApiKeyStore
from alloy.zoo.presets import build_preset, quiet_build_output, register_preset

logger = logging.getLogger("alloy.lifecycle")

DEMO_KEY_FILE = "run/admin-key"
SERVE_CONFIG = PROJECT_ROOT / "configs" / "serve.yaml"
ALLOY_CONFIG = PROJECT_ROOT / "configs" / "alloy.yaml"


@dataclass
class LocalRun:
    """A cluster this process started: its Ray head, the start's context (settings, config holder, database,
    cluster state store) and the persisted step log of the start."""

    url: str
    admin_key: str | None
    head: RayHead
    data_dir: Path
    registered: dict[str, list[str]]
    start: LifecycleRun
    context: StartContext
    build_config: Callable[[], ServeDeploySchema]  # with the config version as a builder arg
    admin_key_file: Path | None = None  # where the start's admin key is kept (admin_key is set only when new)

    @property
    def cluster_state(self) -> ClusterStateStore:
        return self.context["cluster_state"]


def _ray_temp_dir(data_dir: Path) -> Path:
    """A persistent Ray temp dir under the data dir, unless that path is too long for Ray's unix sockets
    (``<temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store`` must stay within 107 bytes)."""
    preferred = data_dir / "ray"
    if len(str(preferred)) <= 40:
        return preferred
    return Path("/tmp") / f"alloy-ray-{hashlib.sha1(str(data_dir).encode()).hexdigest()[:10]}"


def _demo_admin_key(db: Database, settings: Settings, data_dir: Path) -> tuple[str | None, Path | None]:
    """(key to print, file keeping it): a configured key is the operator's (nothing printed or kept); else the
    bootstrap key (first start), printed once and saved (mode 0600); later starts print nothing while the
    saved key is still valid."""
    keys = ApiKeyStore(db)
    key_file = data_dir / DEMO_KEY_FILE
    fresh = keys.ensure_bootstrap_admin(settings.auth.admin_key)
    if settings.auth.admin_key:
        return None, None
    if fresh is None and key_file.exists() and keys.verify(key_file.read_text().strip()) is not None:
        return None, key_file
    if fresh is None:
        _, fresh = keys.create("alloy-start", ["admin"])
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(fresh)
    key_file.chmod(0o600)
    return fresh, key_file


def build_and_register_demo_zoo(settings: Settings) -> dict[str, list[str]]:
    """The demo zoo, built offline (tiny random models, seconds) and registered (idempotent)."""
    quiet_build_output()
    db = Database.from_settings(settings)
    try:
        store = ArtifactStore(settings.artifacts_uri, settings.storage_options)
        models = ModelRegistry.from_settings(settings, db, store)
        datasets = DatasetRegistry(db, store, roots=[Path(r) for r in settings.model_roots] + [settings.data_dir])
        manifest = build_preset("tiny", settings.data_dir)
        return register_preset(manifest, models, datasets, store=store)
    finally:
        db.close()


def start_local(
    *,
    config_path: str | Path | None = None,
    demo: bool = True,
    serve_config: str | Path | None = None,
    warm: bool = False,
    skip_dependency_checks: bool = False,
    echo: Callable[[str], None] = print,
    port: int | None = None,
) -> LocalRun:
    """Start a local Ray head and run the cold (or warm) start sequence on it; returns once READY.

    A failed step raises :class:`alloy.cluster.startup.StepFailed` naming it; the head is stopped again and the
    cluster state is STOPPED with the failed step in its log."""
    settings = local_settings(config_path)
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    running = read_local_state(data_dir)
    if running is not None and pid_alive(running.get("pid")):
        raise AlloyError(
            ErrorCode.CONFLICT,
            f"`alloy start` already runs for {data_dir} (pid {running['pid']}): `alloy stop` it first",
            {"pid": running["pid"]},
        )
    (data_dir / STOP_REQUEST_FILE).unlink(missing_ok=True)

    context = StartContext(mode="warm" if warm else "cold")
    if settings.database_url.startswith("sqlite"):
        # The embedded database is ours to create and migrate, and with it the start is persisted from step 1
        # (an external database is migrated by the operator: "connect registries" refuses an old schema).
        db = Database.from_settings(settings)
        db.upgrade()
        context["db"], context["cluster_state"] = db, ClusterStateStore(db)
    version = context["cluster_state"].get().config_version if "cluster_state" in context.values else 1
    config_file = str(Path(config_path or os.environ.get("ALLOY_CONFIG") or ALLOY_CONFIG).resolve())
    context["config"] = ConfigHolder(settings, version=version, loader=lambda: local_settings(config_file))

    http_port = choose_http_port(port, settings.server.port)  # a busy --port is refused before Ray starts
    echo("starting a local Ray head ...")
    head = start_ray_head(_ray_temp_dir(data_dir), num_cpus=max(8, os.cpu_count() or 1))
    if http_port is None:
        echo(f"port {settings.server.port} is busy: serving on {head.http_port} this time")
        http_port = head.http_port
    url = f"http://127.0.0.1:{http_port}"

    def build_config() -> ServeDeploySchema:
        # The config version is a builder arg so that a reload (SIGHUP) changes the application's code version:
        # Serve then replaces every replica (a rolling restart), and each re-reads the configuration.
        return load_serve_config(
            serve_config or SERVE_CONFIG,
            http_port=http_port,
            app_args={
                "config_path": config_file,
                "settings": {"data_dir": str(data_dir)},
                "config_version": context["config"].version,
            },
        )

    try:
        head.apply_env()
        ray.init(address=head.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        sequence = serve_start_sequence(
            context.mode,
            build_config=build_config,
            base_url=lambda: url,
            skip_dependency_checks=skip_dependency_checks or settings.lifecycle.warm_skip_dependency_checks,
        )
        start = sequence.run(context)
        _write_local_state(data_dir, head, url)
        admin_key, admin_key_file = _demo_admin_key(context["db"], settings, data_dir)
        registered: dict[str, list[str]] = {}
        if demo:
            echo("building and registering the demo zoo (offline, tiny models) ...")
            registered = build_and_register_demo_zoo(settings)
        return LocalRun(
            url=url,
            admin_key=admin_key,
            head=head,
            data_dir=data_dir,
            registered=registered,
            start=start,
            context=context,
            build_config=build_config,
            admin_key_file=admin_key_file,
        )
    except BaseException:
        terminate_local(head, data_dir=data_dir)
        raise


def _write_local_state(data_dir: Path, head: RayHead, url: str) -> None:
    state = {
        "pid": os.getpid(),
        "ray_pid": head.process.pid if head.process else None,
        "url": url,
        "address": head.address,
        "temp_dir": str(head.temp_dir),
        "data_dir": str(data_dir),
        "env": head.env,
    }
    state_file = data_dir / STATE_FILE
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state))
    state_file.chmod(0o600)


def stop_local(
    run: LocalRun, request: StopRequest, *, force_requested: Callable[[], bool] | None = None
) -> ShutdownReport:
    """Run the graceful (or forced) shutdown of :mod:`alloy.cluster.shutdown` on this process's cluster; returns the
    :class:`alloy.cluster.shutdown.ShutdownReport` (its run is persisted as the cluster's last stop)."""
    db, state = run.context["db"], run.cluster_state
    jobs = JobStore(db)
    try:  # what the next `alloy start --warm` restores: the pools as they are when the stop begins
        state.save_pool_snapshot(serve_ops.current_pools())
    except Exception:
        logger.warning("pool snapshot not saved", exc_info=True)

    def close_registries() -> str:
        db.close()  # the pool is disposed; the last steps reconnect only to persist the state
        return "database connections closed"

    actions = ShutdownActions(
        cancel_active=lambda: serve_ops.cancel_active_tasks(jobs),
        flush_tracker=serve_ops.flush_tracker,
        close_registries=close_registries,
        terminate_pools=lambda: terminate_local(run.head, data_dir=run.data_dir),
    )
    timeout_s = (
        request.timeout_s if request.timeout_s is not None else run.context["settings"].lifecycle.shutdown_timeout_s
    )
    shutdown = Shutdown(state, jobs, actions, timeout_s=timeout_s, force_requested=force_requested)
    return shutdown.forced("alloy stop --force") if request.force else shutdown.graceful()


def terminate_local(head: RayHead, *, data_dir: Path | None = None) -> str:
    """Shut the Serve app down (replicas drain, the tracker flushes on its way out), then stop exactly the Ray
    processes of ``head``; the state file goes with them."""
    try:
        if ray.is_initialized():
            if head.process is not None and head.process.poll() is None:
                serve.shutdown()
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the head is stopped below regardless
        pass
    finally:
        stop_ray_head(head)
        if data_dir is not None:
            (data_dir / STATE_FILE).unlink(missing_ok=True)
    return "serve shut down, ray head stopped"


def reload_local(run: LocalRun) -> LifecycleRun:
    """SIGHUP: re-read the configuration and warm-start onto it (dependency checks skipped, pools restored to
    their current sizes by a rolling restart of every replica, abbreviated health checks, READY with the new
    config version). An invalid configuration raises and the running one stays, version unchanged."""
    holder = run.context["config"]
    holder.reload()  # raises on an invalid configuration: nothing below runs
    run.cluster_state.save_pool_snapshot(serve_ops.current_pools())
    context = StartContext(mode="warm", values={k: run.context[k] for k in ("db", "cluster_state", "config")})
    sequence = serve_start_sequence(
        "warm", build_config=run.build_config, base_url=lambda: run.url, skip_dependency_checks=True, recover=False
    )
    result = sequence.run(context)
    run.context["settings"] = context["settings"]
    return result
