"""The Ray Serve side of the cluster lifecycle: the step bodies ``alloy start`` / ``alloy stop`` plug into the
plain sequences of :mod:`alloy.startup` and :mod:`alloy.shutdown`.

- pools: the replica count of each deployment (``current_pools``), persisted as the warm-start snapshot, and
  ``apply_pool_snapshot`` which writes a snapshot back into a Serve config before it is deployed (fixed
  deployments get ``num_replicas``; autoscaled ones ``initial_replicas``, clamped to their min/max);
- endpoint health: every deployment's ``health`` method through its handle, plus the HTTP proxy
  (``check_endpoints``; the abbreviated warm-start check asks the ingress and the engines only);
- replay: a dispatcher per job kind that calls the engine's ``run_job`` without awaiting it, as the ingress does;
- forced cancel: every active job is requeued with an ``interrupted`` event before the processes are killed,
  so the history says when and why (a runner that later tries to finish finds the job moved and cleans up).

- the start sequences themselves (``serve_start_sequence``): the cold or warm sequence of :mod:`alloy.startup`
  with these bodies plugged in, shared by ``alloy start``, the session test fixture and the process tests.

Everything here needs a connected Ray driver (``ray.init(address=...)``) except ``apply_pool_snapshot``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs import JobKind, JobRecord, JobStore
from alloy.startup import StartContext, StartSequence

logger = logging.getLogger("alloy.lifecycle")

APP_NAME = "alloy"
POOL_DEPLOYMENTS = ("MergeEngine", "EvaluationEngine", "EvolutionEngine")
COMPONENTS = ("ModelRegistry", "DatasetRegistry", "ExperimentTracker", "ArtifactStore", *POOL_DEPLOYMENTS)
ABBREVIATED_COMPONENTS = POOL_DEPLOYMENTS
ENGINE_OF_KIND = {JobKind.MERGE: "MergeEngine", JobKind.EVALUATION: "EvaluationEngine",
                  JobKind.EVOLUTION: "EvolutionEngine"}


# --- pools ---------------------------------------------------------------------------------------------------

def current_pools(app_name: str = APP_NAME, names: Iterable[str] = POOL_DEPLOYMENTS) -> dict[str, int]:
    """RUNNING replicas per pool deployment of the application (absent deployments are left out)."""
    from ray import serve

    application = serve.status().applications.get(app_name)
    if application is None:
        return {}
    wanted = set(names)
    return {name: int(sum(count for state, count in overview.replica_states.items()
                          if getattr(state, "value", state) == "RUNNING"))
            for name, overview in application.deployments.items() if name in wanted}


def apply_pool_snapshot(config, pools: dict[str, int], app_name: str = APP_NAME):
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
                scaling = dict(autoscaling) if isinstance(autoscaling, dict) else autoscaling.model_dump()
                low = int(scaling.get("min_replicas") or 0)
                high = int(scaling.get("max_replicas") or max(count, 1))
                scaling["initial_replicas"] = min(max(count, low), high)
                deployment.autoscaling_config = scaling
            else:
                deployment.num_replicas = max(int(count), 1)  # a fixed deployment never runs with zero
    return config


# --- endpoint health -----------------------------------------------------------------------------------------

def check_endpoints(base_url: str, *, app_name: str = APP_NAME, names: Iterable[str] = COMPONENTS,
                    timeout_s: float = 30.0) -> str:
    """Ask every deployed component's ``health`` and the HTTP proxy; raise SERVICE_UNAVAILABLE naming each
    that did not answer."""
    from ray import serve

    from alloy.lifecycle import wait_http_ready

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
        raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE,
                         "health check failed: " + "; ".join(f"{k}: {v}" for k, v in failures.items()),
                         {"failed": sorted(failures), "healthy": answered})
    return f"{len(answered)} endpoints healthy"


# --- replay and cancel ---------------------------------------------------------------------------------------

def replay_dispatchers(app_name: str = APP_NAME) -> dict[JobKind, Callable[[JobRecord], Any]]:
    """One dispatcher per job kind whose engine is deployed: ``run_job`` is called and not awaited (the job is
    then an ongoing request of the engine, as after a normal submission). Kinds without an engine are absent,
    so :meth:`alloy.recovery.Recovery.replay` fails their jobs with a reason."""
    from ray import serve

    application = serve.status().applications.get(app_name)
    deployed = set(application.deployments) if application else set()
    dispatchers: dict[JobKind, Callable[[JobRecord], Any]] = {}
    for kind, engine in ENGINE_OF_KIND.items():
        if engine in deployed:
            handle = serve.get_deployment_handle(engine, app_name=app_name)
            dispatchers[kind] = lambda job, handle=handle: handle.run_job.remote(job.id)
    return dispatchers


def kill_engine_replicas(app_name: str = APP_NAME, engines: Iterable[str] = POOL_DEPLOYMENTS) -> list[str]:
    """SIGKILL the engines' replica actors at once (``ray.kill``, no restart, no shutdown hook): the tasks they
    run stop mid-step, so nothing can write to their jobs afterwards."""
    import ray

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


def cancel_active_tasks(jobs: JobStore, reason: str = "interrupted: forced shutdown",
                        app_name: str = APP_NAME) -> str:
    """Forced shutdown step 1: kill the engine replicas, *then* record every active job as interrupted. In this
    order no runner can finish (or fail) a job after it was requeued: its process is already gone."""
    killed = kill_engine_replicas(app_name)
    return f"{len(killed)} engine replicas killed; {requeue_active(jobs, reason)}"


def requeue_active(jobs: JobStore, reason: str) -> str:
    """Mark every active job interrupted (requeued to CREATED). Only safe once nothing runs them any more
    (after :func:`kill_engine_replicas`, or at start before the pools exist)."""
    requeued = []
    for job in jobs.active():
        try:
            jobs.requeue(job.id, reason)
            requeued.append(job.id)
        except AlloyError:
            continue  # it finished meanwhile
    return f"{len(requeued)} active jobs requeued"


def flush_tracker(app_name: str = APP_NAME, timeout_s: float = 30.0) -> str:
    """Graceful shutdown step 3: the ExperimentTracker writes its buffered logs (its log sequence number)."""
    from ray import serve

    handle = serve.get_deployment_handle("ExperimentTracker", app_name=app_name)
    return f"lsn {handle.flush.remote().result(timeout_s=timeout_s)}"


# --- the start sequences -------------------------------------------------------------------------------------

def merge_scratch_dir(settings) -> Path:
    """Where MergeEngine replicas write merge outputs before registering them (partial outputs live here)."""
    return Path(settings.data_dir).resolve() / "work" / "merges"


def serve_start_sequence(mode: str, *, build_config: Callable[[], Any], base_url: Callable[[], str],
                         skip_dependency_checks: bool = False, gpu_count: Callable[[], float] | None = None,
                         deploy_timeout_s: float = 600.0, recover: bool = True) -> StartSequence:
    """The cold (``mode="cold"``) or warm start of the specification with the Serve step bodies:

    - consistency check and repair (:class:`alloy.recovery.Recovery`) before any pool exists;
    - initialise (cold) or restore (warm: the persisted replica counts) the worker pools by deploying
      ``build_config()`` (a ``ServeDeploySchema``), then persist the pools as the next warm start's snapshot;
    - health checks: every component and the HTTP proxy at ``base_url()`` (warm: the engines and the proxy);
    - READY, then the interrupted jobs are replayed.

    ``recover=False`` leaves out the consistency check and the replay: a reload warm-starts a running cluster,
    whose active jobs are not interrupted. The caller provides a connected Ray driver and a
    :class:`StartContext` whose ``config`` is the ``ConfigHolder`` to start with."""
    from alloy import startup
    from alloy.dependencies import ray_gpu_count
    from alloy.lifecycle import deploy_serve_config
    from alloy.recovery import Recovery

    def check_consistency(ctx: StartContext) -> str:
        recovery = Recovery(ctx["db"], ctx["store"], models=ctx["models"], state=ctx["cluster_state"],
                            scratch_dirs=[merge_scratch_dir(ctx["settings"])])
        report = recovery.check()
        ctx["recovery"], ctx["consistency"] = recovery, report
        return f"{report.summary()}; repaired: {recovery.repair(report).summary()}"

    def deploy_pools(ctx: StartContext) -> str:
        config = build_config()
        if ctx.mode == "warm":
            config = apply_pool_snapshot(config, ctx["cluster_state"].pool_snapshot())
        deploy_serve_config(config, timeout_s=deploy_timeout_s)
        pools = current_pools()
        ctx["cluster_state"].save_pool_snapshot(pools)
        return ", ".join(f"{name} x{count}" for name, count in sorted(pools.items())) or "no pools"

    def health_check(ctx: StartContext) -> str:
        names = COMPONENTS if ctx.mode == "cold" else ABBREVIATED_COMPONENTS
        return check_endpoints(base_url(), names=names)

    def replay(ctx: StartContext) -> str:
        report = ctx["recovery"].replay(replay_dispatchers())
        ctx["replay"] = report
        return f"{len(report.dispatched)} jobs replayed, {len(report.failed)} failed"

    validate = startup.dependency_validation(gpu_count=gpu_count or ray_gpu_count)
    if not recover:
        check_consistency = replay = None  # type: ignore[assignment]
    if mode == "cold":
        return startup.cold_start(load_configuration=startup.load_configuration, validate_dependencies=validate,
                                  connect_registries=startup.connect_registries,
                                  check_consistency=check_consistency, initialise_pools=deploy_pools,
                                  health_check=health_check, replay=replay)
    if mode == "warm":
        return startup.warm_start(load_configuration=startup.load_configuration,
                                  connect_registries=startup.connect_registries,
                                  skip_dependency_checks=skip_dependency_checks, validate_dependencies=validate,
                                  check_consistency=check_consistency, restore_pools=deploy_pools,
                                  health_check=health_check, replay=replay)
    raise ValueError(f"mode must be cold or warm, not {mode!r}")
