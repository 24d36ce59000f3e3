"""The Ray Serve side of the cluster lifecycle: the step bodies ``alloy start`` / ``alloy stop`` plug into the
plain sequences of :mod:`alloy.cluster.startup` and :mod:`alloy.cluster.shutdown`.

- pools: the replica count of each deployment (``current_pools``), persisted as the warm-start snapshot, and
  ``apply_pool_snapshot`` which writes a snapshot back into a Serve config before it is deployed (fixed
  deployments get ``num_replicas``; autoscaled ones ``initial_replicas``, clamped to their min/max);
- endpoint health: every deployment's ``health`` method through its handle, plus the HTTP proxy
  (``check_endpoints``; the abbreviated warm-start check asks the ingress and the engines only);
- replay: a dispatcher per job kind that calls the engine's ``run_job`` without awaiting it, as the ingress does;
- forced cancel: every active job is requeued with an ``interrupted`` event before the processes are killed,
  so the history says when and why (a runner that later tries to finish finds the job moved and cleans up).

Everything here needs a connected Ray driver (``ray.init(address=...)``) except ``apply_pool_snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ServeDeploySchema

from alloy.components import APP_NAME, BACKENDS, ENGINE_OF_KIND, ENGINES, EXPERIMENT_TRACKER
from alloy.control.serve_deploy import wait_http_ready
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.liveness import requeue_lost
from alloy.jobs.records import JobKind, JobRecord
from alloy.jobs.store import JobStore

POOL_DEPLOYMENTS = ENGINES


# --- pools ---------------------------------------------------------------------------------------------------


def current_pools(app_name: str = APP_NAME, names: Iterable[str] = POOL_DEPLOYMENTS) -> dict[str, int]:
    """RUNNING replicas per pool deployment of the application (absent deployments are left out)."""
    application = serve.status().applications.get(app_name)
    if application is None:
        return {}
    wanted = set(names)
    return {
        name: int(
            sum(
                count for state, count in overview.replica_states.items() if getattr(state, "value", state) == "RUNNING"
            )
        )
        for name, overview in application.deployments.items()
        if name in wanted
    }


def apply_pool_snapshot(
    config: ServeDeploySchema, pools: dict[str, int], app_name: str = APP_NAME
) -> ServeDeploySchema:
    """A copy of a ``ServeDeploySchema`` whose pool deployments start with the snapshot's replica counts."""
    if not pools:
        return config
    config = config.model_copy(deep=True)
    for application in config.applications:
        if application.name != app_name:
            continue
        for deployment in application.deployments or []:
            count = pools.get(deployment.name)
            if count is None:
                continue
            autoscaling = deployment.autoscaling_config  # a dict, an AutoscalingConfig, None or Serve's DEFAULT
            if isinstance(autoscaling, dict) or hasattr(autoscaling, "model_dump"):
                scaling = dict(autoscaling) if isinstance(autoscaling, dict) else autoscaling.model_dump()  # type: ignore[union-attr]
                low = int(scaling.get("min_replicas") or 0)
                high = int(scaling.get("max_replicas") or max(count, 1))
                scaling["initial_replicas"] = min(max(count, low), high)
                deployment.autoscaling_config = scaling
            else:
                deployment.num_replicas = max(int(count), 1)  # a fixed deployment never runs with zero
    return config


# --- endpoint health -----------------------------------------------------------------------------------------


def check_endpoints(
    base_url: str, *, app_name: str = APP_NAME, names: Iterable[str] = BACKENDS, timeout_s: float = 30.0
) -> str:
    """Ask every deployed component's ``health`` and the HTTP proxy; raise SERVICE_UNAVAILABLE naming each
    that did not answer."""
    application = serve.status().applications.get(app_name)
    deployed = set(application.deployments) if application else set()
    failures: dict[str, str] = {}
    answered = []
    for name in names:
        if name not in deployed:
            continue
        try:
            serve.get_deployment_handle(name, app_name=app_name).health.remote().result(timeout_s=timeout_s)
            answered.append(name)
        except Exception as exc:  # noqa: BLE001 - collected and reported together
            failures[name] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        wait_http_ready(f"{base_url.rstrip('/')}/docs", timeout_s=timeout_s)
        answered.append("HTTP proxy")
    except AlloyError as exc:
        failures["HTTP proxy"] = exc.message
    if failures:
        raise AlloyError(
            ErrorCode.SERVICE_UNAVAILABLE,
            "health check failed: " + "; ".join(f"{k}: {v}" for k, v in failures.items()),
            {"failed": sorted(failures), "healthy": answered},
        )
    return f"{len(answered)} endpoints healthy"


# --- replay and cancel ---------------------------------------------------------------------------------------


def replay_dispatchers(app_name: str = APP_NAME) -> dict[JobKind, Callable[[JobRecord], Any]]:
    """One dispatcher per job kind whose engine is deployed: ``run_job`` is called and not awaited (the job is
    then an ongoing request of the engine, as after a normal submission). Kinds without an engine are absent,
    so :meth:`alloy.cluster.recovery.Recovery.replay` fails their jobs with a reason."""
    application = serve.status().applications.get(app_name)
    deployed = set(application.deployments) if application else set()
    dispatchers: dict[JobKind, Callable[[JobRecord], Any]] = {}
    for kind in JobKind:
        engine = ENGINE_OF_KIND[kind.value]
        if engine in deployed:
            dispatchers[kind] = _dispatcher(serve.get_deployment_handle(engine, app_name=app_name))
    return dispatchers


def _dispatcher(handle: DeploymentHandle) -> Callable[[JobRecord], Any]:
    def dispatch(job: JobRecord) -> Any:
        return handle.run_job.remote(job.id)

    return dispatch


def kill_engine_replicas(app_name: str = APP_NAME, engines: Iterable[str] = POOL_DEPLOYMENTS) -> list[str]:
    """SIGKILL the engines' replica actors at once (``ray.kill``, no restart, no shutdown hook): the tasks they
    run stop mid-step, so nothing can write to their jobs afterwards."""
    prefixes = tuple(f"SERVE_REPLICA::{app_name}#{engine}#" for engine in engines)
    killed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = actor["name"], actor["namespace"]
        if not name.startswith(prefixes):
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:
            continue  # already gone
    return killed


def cancel_active_tasks(jobs: JobStore, reason: str = "interrupted: forced shutdown", app_name: str = APP_NAME) -> str:
    """Forced shutdown step 1: kill the engine replicas, *then* record every active job as interrupted. In this
    order no runner can finish (or fail) a job after it was requeued: its process is already gone."""
    killed = kill_engine_replicas(app_name)
    return f"{len(killed)} engine replicas killed; {requeue_active(jobs, reason)}"


def requeue_active(jobs: JobStore, reason: str) -> str:
    """Mark every job a run held interrupted (requeued to CREATED, one attempt each; CREATED jobs are already
    queued). Only safe once nothing runs them any more (after :func:`kill_engine_replicas`, or at start before
    the pools exist)."""
    requeued = [job.id for job in jobs.active() if requeue_lost(jobs, job, reason) is not None]
    return f"{len(requeued)} active jobs requeued"


def flush_tracker(app_name: str = APP_NAME, timeout_s: float = 30.0) -> str:
    """Graceful shutdown step 3: the ExperimentTracker writes its buffered logs (its log sequence number)."""
    handle = serve.get_deployment_handle(EXPERIMENT_TRACKER, app_name=app_name)
    return f"lsn {handle.flush.remote().result(timeout_s=timeout_s)}"
