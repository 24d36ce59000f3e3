"""Starting and stopping a local Ray head and deploying the Serve app on it.

Shared by ``alloy start`` and the test fixtures so that both follow one port discipline: every port Ray opens is
chosen from a free range that stays clear of the ports other software on a shared machine expects (6379, 8000,
8265, 10002-19999), and the head is stopped by the process ids it started, never by ``ray stop`` (which kills
every Ray process on the machine).

Token authentication: Ray 2.5x+ enables token auth for new clusters when ``RAY_AUTH_MODE`` is unset and a token
file exists. We make it explicit: ``RAY_AUTH_MODE=token`` and a freshly generated ``RAY_AUTH_TOKEN`` in the
environment of the head and of every driver that connects (``RayHead.env``), so nothing is written to
``~/.ray/auth_token`` and two clusters on one machine never share a token.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alloy.errors import AlloyError, ErrorCode

# Ports we may use; everything below 20000 is left alone (Redis 6379, Serve 8000, dashboard 8265, and the
# 10002-19999 range other tools on the machine use).
PORT_RANGE = (20000, 39999)
FORBIDDEN_PORTS = {6379, 8000, 8265}
WORKER_PORT_SPAN = 200

RAY_PORT_FLAGS = (
    "port",
    "ray-client-server-port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "node-manager-port",
    "object-manager-port",
)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port_block(count: int, *, span_after: int = 0, rng: random.Random | None = None) -> list[int]:
    """``count`` consecutive free ports followed by ``span_after`` more free ones (worker ports), from a random
    base inside PORT_RANGE so two concurrent runs almost never collide (and a taken port is skipped anyway)."""
    rng = rng or random.Random(os.getpid() ^ time.time_ns())
    low, high = PORT_RANGE
    needed = count + span_after
    for _ in range(200):
        base = rng.randrange(low, high - needed)
        block = range(base, base + needed)
        if any(p in FORBIDDEN_PORTS for p in block):
            continue
        # Checking every worker port would be slow and racy; the named ports must be free, worker ports are
        # sampled.
        if all(_port_is_free(p) for p in block[:count]) and all(
            _port_is_free(p) for p in block[count:: max(1, span_after // 8)]
        ):
            return list(block)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"no free block of {needed} ports in {PORT_RANGE}")


@dataclass
class RayHead:
    """A running local Ray head started by us."""

    address: str
    ports: dict[str, int]
    http_port: int
    temp_dir: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None
    pid_file: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def apply_env(self) -> None:
        """Make this process a client of this head (token auth included)."""
        os.environ.update(self.env)
        if "ray._raylet" in sys.modules:
            # Ray caches the auth mode and token when it is imported; refresh both (config first, as Ray's own
            # test utilities do) or an already-imported ray keeps connecting without the token.
            from ray._raylet import AuthenticationTokenLoader, Config

            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()


def auth_env(token: str | None = None) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token or secrets.token_hex(32)}


def start_ray_head(
    temp_dir: str | Path,
    *,
    num_cpus: int = 8,
    num_gpus: int | None = None,
    include_dashboard: bool = True,
    ready_timeout_s: float = 120.0,
    log_file: Path | None = None,
) -> RayHead:
    """Start ``ray start --head --block`` in its own process group with every port from the free range.

    ``temp_dir`` should be short: Ray puts unix sockets under it and socket paths are limited to ~107 bytes.
    """
    temp_dir = Path(temp_dir)
    temp_dir.mkdir(parents=True, exist_ok=True)
    ports_block = pick_port_block(len(RAY_PORT_FLAGS) + 1, span_after=WORKER_PORT_SPAN)
    ports = dict(zip(RAY_PORT_FLAGS, ports_block))
    http_port = ports_block[len(RAY_PORT_FLAGS)]
    worker_min = ports_block[len(RAY_PORT_FLAGS) + 1]
    worker_max = ports_block[-1]

    env = auth_env()
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1",
        "--temp-dir", str(temp_dir),
        "--num-cpus", str(num_cpus),
        "--include-dashboard", "true" if include_dashboard else "false",
        "--dashboard-host", "127.0.0.1",
        "--min-worker-port", str(worker_min),
        "--max-worker-port", str(worker_max),
        "--disable-usage-stats",
    ]
    if num_gpus is not None:
        command += ["--num-gpus", str(num_gpus)]
    for flag, port in ports.items():
        command += [f"--{flag}", str(port)]

    child_env = {**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0"}
    output = open(log_file or temp_dir / "ray-head.log", "ab")
    process = subprocess.Popen(
        command, env=child_env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )
    head = RayHead(
        address=f"127.0.0.1:{ports['port']}", ports=ports, http_port=http_port, temp_dir=temp_dir, env=env,
        process=process,
    )
    try:
        _wait_for_gcs(head, ready_timeout_s)
    except BaseException:
        stop_ray_head(head)
        raise
    return head


def _wait_for_gcs(head: RayHead, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.process is not None and head.process.poll() is not None:
            log = (head.temp_dir / "ray-head.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"ray start exited early:\n{tail}")
        # The raylet registers after the GCS; its port answering means the node is usable.
        if not _port_is_free(head.ports["port"]) and not _port_is_free(head.ports["node-manager-port"]):
            return
        time.sleep(0.5)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"ray head did not come up in {timeout_s:.0f}s")


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def stop_ray_head(head: RayHead, *, timeout_s: float = 30.0) -> None:
    """Stop exactly the processes of this head: the ``ray start`` process, its descendants, its process group."""
    import psutil

    if head.process is None:
        return
    root = head.process.pid
    tree = _descendants(root)
    # ray start --block tears down its own node on SIGTERM; give it the chance first.
    try:
        head.process.send_signal(signal.SIGTERM)
        head.process.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    survivors = []
    for pid in tree + _descendants(root):
        try:
            proc = psutil.Process(pid)
            proc.kill()
            survivors.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(survivors, timeout=10)
    try:
        os.killpg(root, signal.SIGKILL)  # the process group we created with start_new_session
    except (ProcessLookupError, PermissionError):
        pass
    if head.process.poll() is None:
        head.process.kill()
        head.process.wait(timeout=10)


# --- Serve deployment --------------------------------------------------------------------------------------

def load_serve_config(path: str | Path, *, app_args: dict[str, Any] | None = None, http_port: int | None = None):
    """Read a Serve config file (``configs/serve.yaml``) into Ray's own schema, with the first application's
    builder args updated by ``app_args`` and the proxy port set to ``http_port``."""
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    if app_args:
        application = raw["applications"][0]
        application["args"] = {**(application.get("args") or {}), **app_args}
    if http_port is not None:
        raw.setdefault("http_options", {})
        raw["http_options"].update({"host": "127.0.0.1", "port": http_port})
    return ServeDeploySchema.model_validate(raw)


def deploy_serve_config(config, *, timeout_s: float = 300.0) -> None:
    """Deploy a ServeDeploySchema the way ``serve run config.yaml`` does (start Serve, then apply the config on
    the controller) and wait until every application is RUNNING. The caller must be connected (``ray.init``)."""
    from ray import serve
    from ray.serve._private.api import serve_start

    client = serve_start(http_options=config.http_options.model_dump())
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
    import httpx

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


# --- multi-node storage rule --------------------------------------------------------------------------------

def check_storage_for_cluster(settings, alive_nodes: int) -> None:
    """More than one node needs shared storage: a SQLite database or a local artifact folder would be seen by
    one node only, so jobs would vanish or models would be missing on the others. Refuse at startup."""
    if alive_nodes <= 1:
        return
    problems = []
    if settings.database_url.startswith("sqlite"):
        problems.append(f"database.url is SQLite ({settings.database_url}); use PostgreSQL")
    if "://" not in settings.artifacts_uri or settings.artifacts_uri.startswith("file://"):
        problems.append(f"artifacts.uri is a local folder ({settings.artifacts_uri}); use s3://bucket/prefix")
    if problems:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"this Ray cluster has {alive_nodes} nodes, which needs shared storage: " + "; ".join(problems),
            {"alive_nodes": alive_nodes, "problems": problems},
        )


def alive_ray_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def drain_ray_node(node_id: str | None, reason: str, deadline_s: int | None) -> tuple[str, bool, str]:
    """Ask the GCS to drain a node (Ray's own drain API, as ``ray drain-node`` and autoscaler v2 use it): no new
    tasks or actors are scheduled there and running ones finish. The head node cannot be drained; without a
    node id the only worker node is chosen. Returns (node_id, accepted, message)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    nodes = [n for n in alive_ray_nodes()]
    if node_id is None:
        workers = [n for n in nodes if "node:__internal_head__" not in (n.get("Resources") or {})]
        if len(workers) != 1:
            raise AlloyError(
                ErrorCode.CONFLICT if not workers else ErrorCode.VALIDATION_FAILED,
                "no worker node to drain (the head node cannot be drained)" if not workers
                else f"{len(workers)} worker nodes: name one with node_id",
                {"workers": [n["NodeID"] for n in workers]},
            )
        node_id = workers[0]["NodeID"]
    elif node_id not in {n["NodeID"] for n in nodes}:
        raise AlloyError(ErrorCode.NOT_FOUND, f"node {node_id!r} is not an alive node of this cluster",
                         {"node_id": node_id})
    deadline_ms = int(time.time() * 1000) + deadline_s * 1000 if deadline_s else 0
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, message = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), reason, deadline_ms,
    )
    return node_id, bool(accepted), message or ""


# --- `alloy start` / `alloy stop` / `alloy status` ---------------------------------------------------------
#
# `alloy start` runs in the foreground: it owns the Ray driver and the head's process, so it is the process
# that runs the start sequence (alloy.startup via alloy.cluster_ops) and, when `alloy stop` signals it, the
# shutdown (alloy.shutdown). The lifecycle state itself lives in the database (alloy.cluster_state); the files
# below only tell `alloy stop` which process to signal and what it asked for.

STATE_FILE = "run/alloy-start.json"
STOP_REQUEST_FILE = "run/stop-request.json"
DEMO_KEY_FILE = "run/admin-key"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
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
    start: Any  # alloy.cluster_state.LifecycleRun
    context: Any  # alloy.startup.StartContext
    build_config: Any  # () -> ServeDeploySchema, with the config version as a builder arg
    admin_key_file: Path | None = None  # where the start's admin key is kept (admin_key is set only when new)

    @property
    def cluster_state(self):
        return self.context["cluster_state"]


@dataclass
class StopRequest:
    """What `alloy stop` asks of the foreground `alloy start` (written next to the state file, then SIGTERM)."""

    force: bool = False
    timeout_s: float | None = None  # None: lifecycle.shutdown_timeout_s


def write_stop_request(data_dir: Path, request: StopRequest) -> None:
    import json

    path = Path(data_dir) / STOP_REQUEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"force": request.force, "timeout_s": request.timeout_s}))


def take_stop_request(data_dir: Path) -> StopRequest:
    """The pending request (consumed), or a graceful stop with the configured timeout (SIGTERM, Ctrl-C)."""
    import json

    path = Path(data_dir) / STOP_REQUEST_FILE
    if not path.exists():
        return StopRequest()
    raw = json.loads(path.read_text())
    path.unlink(missing_ok=True)
    return StopRequest(force=bool(raw.get("force")), timeout_s=raw.get("timeout_s"))


def local_settings(config_path: str | Path | None = None):
    """The settings `alloy start/stop/status` use: the config file (``--config`` or ALLOY_CONFIG), with the data
    dir made absolute so every process opens the same database."""
    from alloy.config import load_settings

    if config_path:
        os.environ["ALLOY_CONFIG"] = str(Path(config_path).resolve())
    settings = load_settings()
    # A data dir given by the user (--data-dir, ALLOY_DATA_DIR) is relative to where they are; one from the
    # config file is relative to the project root, as the Serve builder pins it: any folder finds the same data.
    anchor = Path.cwd() if "ALLOY_DATA_DIR" in os.environ else PROJECT_ROOT
    return load_settings(data_dir=str((anchor / settings.data_dir).resolve()))


def _ray_temp_dir(data_dir: Path) -> Path:
    """A persistent Ray temp dir under the data dir, unless that path is too long for Ray's unix sockets
    (``<temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store`` must stay within 107 bytes)."""
    preferred = data_dir / "ray"
    if len(str(preferred)) <= 40:
        return preferred
    import hashlib

    return Path("/tmp") / f"alloy-ray-{hashlib.sha1(str(data_dir).encode()).hexdigest()[:10]}"


def _demo_admin_key(db, settings, data_dir: Path) -> tuple[str | None, Path | None]:
    """(key to print, file keeping it): a configured key is the operator's (nothing printed or kept); else the
    bootstrap key (first start), printed once and saved (mode 0600); later starts print nothing while the
    saved key is still valid."""
    from alloy.keys import ApiKeyStore

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


def build_and_register_demo_zoo(settings) -> dict[str, list[str]]:
    """The demo zoo, built offline (tiny random models, seconds) and registered (idempotent)."""
    from alloy.artifacts import ArtifactStore
    from alloy.db import Database
    from alloy.registry.datasets import DatasetRegistry
    from alloy.registry.models import ModelRegistry
    from alloy.zoo.presets import build_preset, quiet_build_output, register_preset

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


def start_local(*, config_path: str | Path | None = None, demo: bool = True, serve_config: str | Path | None = None,
                warm: bool = False, skip_dependency_checks: bool = False, echo=print,
                port: int | None = None) -> LocalRun:
    """Start a local Ray head and run the cold (or warm) start sequence on it; returns once READY.

    A failed step raises :class:`alloy.startup.StepFailed` naming it; the head is stopped again and the
    cluster state is STOPPED with the failed step in its log."""
    import ray

    from alloy import cluster_ops
    from alloy.cluster_state import ClusterStateStore
    from alloy.db import Database
    from alloy.startup import StartContext
    from serve_app.context import AppConfigHolder

    settings = local_settings(config_path)
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    running = read_local_state(data_dir)
    if running is not None and pid_alive(running.get("pid")):
        raise AlloyError(ErrorCode.CONFLICT, f"`alloy start` already runs for {data_dir} (pid {running['pid']}): "
                                             "`alloy stop` it first", {"pid": running["pid"]})
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
    context["config"] = AppConfigHolder(lambda: local_settings(config_file), settings, version=version)

    from alloy.http_port import choose_http_port

    http_port = choose_http_port(port, settings.server.port)  # a busy --port is refused before Ray starts
    echo("starting a local Ray head ...")
    head = start_ray_head(_ray_temp_dir(data_dir), num_cpus=max(8, os.cpu_count() or 1))
    if http_port is None:
        echo(f"port {settings.server.port} is busy: serving on {head.http_port} this time")
        http_port = head.http_port
    url = f"http://127.0.0.1:{http_port}"

    def build_config():
        # The config version is a builder arg so that a reload (SIGHUP) changes the application's code version:
        # Serve then replaces every replica (a rolling restart), and each re-reads the configuration.
        return load_serve_config(serve_config or SERVE_CONFIG, http_port=http_port, app_args={
            "config_path": config_file, "settings": {"data_dir": str(data_dir)},
            "config_version": context["config"].version})

    try:
        head.apply_env()
        ray.init(address=head.address, namespace="alloy", log_to_driver=False)
        sequence = cluster_ops.serve_start_sequence(
            context.mode, build_config=build_config, base_url=lambda: url,
            skip_dependency_checks=skip_dependency_checks or settings.lifecycle.warm_skip_dependency_checks)
        start = sequence.run(context)
        _write_local_state(data_dir, head, url)
        admin_key, admin_key_file = _demo_admin_key(context["db"], settings, data_dir)
        registered: dict[str, list[str]] = {}
        if demo:
            echo("building and registering the demo zoo (offline, tiny models) ...")
            registered = build_and_register_demo_zoo(settings)
        return LocalRun(url=url, admin_key=admin_key, head=head, data_dir=data_dir, registered=registered,
                        start=start, context=context, build_config=build_config, admin_key_file=admin_key_file)
    except BaseException:
        terminate_local(head, data_dir=data_dir)
        raise


def _write_local_state(data_dir: Path, head: RayHead, url: str) -> None:
    import json

    state = {"pid": os.getpid(), "ray_pid": head.process.pid if head.process else None, "url": url,
             "address": head.address, "temp_dir": str(head.temp_dir), "data_dir": str(data_dir), "env": head.env}
    state_file = data_dir / STATE_FILE
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state))
    state_file.chmod(0o600)


def stop_local(run: LocalRun, request: StopRequest, *, force_requested=None):
    """Run the graceful (or forced) shutdown of :mod:`alloy.shutdown` on this process's cluster; returns the
    :class:`alloy.shutdown.ShutdownReport` (its run is persisted as the cluster's last stop)."""
    import logging

    from alloy import cluster_ops
    from alloy.jobs import JobStore
    from alloy.shutdown import Shutdown, ShutdownActions

    db, state = run.context["db"], run.cluster_state
    jobs = JobStore(db)
    try:  # what the next `alloy start --warm` restores: the pools as they are when the stop begins
        state.save_pool_snapshot(cluster_ops.current_pools())
    except Exception:  # noqa: BLE001 - a dead Ray head must not keep the stop from running
        logging.getLogger("alloy.lifecycle").warning("pool snapshot not saved", exc_info=True)

    def close_registries() -> str:
        db.close()  # the pool is disposed; the last steps reconnect only to persist the state
        return "database connections closed"

    actions = ShutdownActions(
        cancel_active=lambda: cluster_ops.cancel_active_tasks(jobs),
        flush_tracker=cluster_ops.flush_tracker,
        close_registries=close_registries,
        terminate_pools=lambda: terminate_local(run.head, data_dir=run.data_dir),
    )
    timeout_s = request.timeout_s if request.timeout_s is not None else \
        run.context["settings"].lifecycle.shutdown_timeout_s
    shutdown = Shutdown(state, jobs, actions, timeout_s=timeout_s, force_requested=force_requested)
    return shutdown.forced("alloy stop --force") if request.force else shutdown.graceful()


def terminate_local(head: RayHead, *, data_dir: Path | None = None) -> str:
    """Shut the Serve app down (replicas drain, the tracker flushes on its way out), then stop exactly the Ray
    processes of ``head``; the state file goes with them."""
    import ray

    try:
        if ray.is_initialized():
            if head.process is not None and head.process.poll() is None:
                from ray import serve

                serve.shutdown()
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the head is stopped below regardless
        pass
    finally:
        stop_ray_head(head)
        if data_dir is not None:
            (data_dir / STATE_FILE).unlink(missing_ok=True)
    return "serve shut down, ray head stopped"


def reload_local(run: LocalRun):
    """SIGHUP: re-read the configuration and warm-start onto it (dependency checks skipped, pools restored to
    their current sizes by a rolling restart of every replica, abbreviated health checks, READY with the new
    config version). An invalid configuration raises and the running one stays, version unchanged."""
    from alloy import cluster_ops
    from alloy.startup import StartContext

    holder = run.context["config"]
    holder.reload()  # raises on an invalid configuration: nothing below runs
    run.cluster_state.save_pool_snapshot(cluster_ops.current_pools())
    context = StartContext(mode="warm", values={k: run.context[k] for k in ("db", "cluster_state", "config")})
    sequence = cluster_ops.serve_start_sequence("warm", build_config=run.build_config, base_url=lambda: run.url,
                                                skip_dependency_checks=True, recover=False)
    result = sequence.run(context)
    run.context["settings"] = context["settings"]
    return result


def read_local_state(data_dir: Path) -> dict[str, Any] | None:
    import json

    state_file = Path(data_dir) / STATE_FILE
    if not state_file.exists():
        return None
    return json.loads(state_file.read_text())


def pid_alive(pid: int | None) -> bool:
    """Whether the process runs; a zombie (exited, not yet reaped by its parent) does not."""
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
