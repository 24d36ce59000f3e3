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


# --- cluster state (the single cluster_state row) -----------------------------------------------------------

READY, STOPPED, STARTING = "READY", "STOPPED", "STARTING"


def read_cluster_state(db) -> dict[str, Any]:
    from alloy.db.models import ClusterStateRow

    with db.session() as session:
        row = session.get(ClusterStateRow, 1)
        if row is None:
            return {"state": STOPPED, "config_version": 1, "snapshot": {}}
        return {"state": row.state, "config_version": row.config_version, "snapshot": dict(row.snapshot or {})}


def write_cluster_state(db, *, state: str | None = None, config_version: int | None = None,
                        snapshot_update: dict[str, Any] | None = None) -> dict[str, Any]:
    from alloy.db.models import ClusterStateRow
    from alloy.db.types import utcnow

    with db.session() as session:
        row = session.get(ClusterStateRow, 1)
        if row is None:
            row = ClusterStateRow(id=1, state=state or STARTING, config_version=config_version or 1, snapshot={})
            session.add(row)
        if state is not None:
            row.state = state
        if config_version is not None:
            row.config_version = config_version
        if snapshot_update:
            row.snapshot = {**(row.snapshot or {}), **snapshot_update}
        row.updated_at = utcnow()
        return {"state": row.state, "config_version": row.config_version, "snapshot": dict(row.snapshot or {})}


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

STATE_FILE = "run/alloy-start.json"
DEMO_KEY_FILE = "run/admin-key"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LocalRun:
    url: str
    admin_key: str | None
    head: RayHead
    data_dir: Path
    registered: dict[str, list[str]]


def _ray_temp_dir(data_dir: Path) -> Path:
    """A persistent Ray temp dir under the data dir, unless that path is too long for Ray's unix sockets."""
    preferred = data_dir / "ray"
    if len(str(preferred)) <= 60:
        return preferred
    import hashlib

    return Path("/tmp") / f"alloy-ray-{hashlib.sha1(str(data_dir).encode()).hexdigest()[:10]}"


def _demo_admin_key(db, settings, data_dir: Path) -> str | None:
    """The admin key to print: a configured one is the operator's; else the bootstrap key (first start) or the
    demo key saved (mode 0600) by an earlier start and still valid."""
    from alloy.keys import ApiKeyStore

    keys = ApiKeyStore(db)
    key_file = data_dir / DEMO_KEY_FILE
    fresh = keys.ensure_bootstrap_admin(settings.auth.admin_key)
    if settings.auth.admin_key:
        return None
    if fresh is None and key_file.exists() and keys.verify(key_file.read_text().strip()) is not None:
        return key_file.read_text().strip()
    if fresh is None:
        _, fresh = keys.create("alloy-start", ["admin"])
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(fresh)
    key_file.chmod(0o600)
    return fresh


def build_and_register_demo_zoo(settings) -> dict[str, list[str]]:
    """The demo zoo, built offline (tiny random models, seconds) and registered (idempotent)."""
    from alloy.artifacts import ArtifactStore
    from alloy.db import Database
    from alloy.registry.datasets import DatasetRegistry
    from alloy.registry.models import ModelRegistry
    from alloy.zoo.presets import build_preset, register_preset

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
                echo=print) -> LocalRun:
    """Start a local Ray head and the app on embedded defaults; returns once /health answers."""
    import json

    import ray

    from alloy.config import load_settings
    from alloy.db import Database

    if config_path:
        os.environ["ALLOY_CONFIG"] = str(config_path)
    settings = load_settings()
    data_dir = Path(settings.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = load_settings(data_dir=str(data_dir))

    db = Database.from_settings(settings)
    try:
        db.upgrade()  # the embedded database is ours to create and migrate
        admin_key = _demo_admin_key(db, settings, data_dir)
    finally:
        db.close()

    echo("starting a local Ray head ...")
    head = start_ray_head(_ray_temp_dir(data_dir), num_cpus=max(8, os.cpu_count() or 1))
    try:
        head.apply_env()
        ray.init(address=head.address, namespace="alloy", log_to_driver=False)
        echo("deploying the Serve app ...")
        config = load_serve_config(
            serve_config or PROJECT_ROOT / "configs" / "serve.yaml",
            app_args={"config_path": str(config_path or os.environ.get("ALLOY_CONFIG") or
                                         PROJECT_ROOT / "configs" / "alloy.yaml"),
                      "settings": {"data_dir": str(data_dir)}},
            http_port=head.http_port,
        )
        deploy_serve_config(config, timeout_s=600)
        url = f"http://127.0.0.1:{head.http_port}"
        wait_http_ready(f"{url}/docs", timeout_s=120)
        registered: dict[str, list[str]] = {}
        if demo:
            echo("building and registering the demo zoo (offline, tiny models) ...")
            registered = build_and_register_demo_zoo(settings)
        state = {"pid": os.getpid(), "ray_pid": head.process.pid if head.process else None, "url": url,
                 "address": head.address, "temp_dir": str(head.temp_dir), "data_dir": str(data_dir),
                 "env": head.env}
        state_file = data_dir / STATE_FILE
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state))
        state_file.chmod(0o600)
        return LocalRun(url=url, admin_key=admin_key, head=head, data_dir=data_dir, registered=registered)
    except BaseException:
        stop_local_head(head)
        raise


def stop_local_head(head: RayHead, *, data_dir: Path | None = None, drain_s: float = 60.0) -> None:
    """Shut the app down (Serve drains replicas, the tracker flushes on its way out), then stop the head."""
    import ray

    try:
        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the head is stopped below regardless
        pass
    finally:
        stop_ray_head(head)
        if data_dir is not None:
            (data_dir / STATE_FILE).unlink(missing_ok=True)
            _mark_stopped(data_dir)


def _mark_stopped(data_dir: Path) -> None:
    from alloy.config import load_settings
    from alloy.db import Database

    db = Database.from_settings(load_settings(data_dir=str(data_dir)))
    try:
        write_cluster_state(db, state=STOPPED)
    finally:
        db.close()


def read_local_state(data_dir: Path) -> dict[str, Any] | None:
    import json

    state_file = Path(data_dir) / STATE_FILE
    if not state_file.exists():
        return None
    return json.loads(state_file.read_text())


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
