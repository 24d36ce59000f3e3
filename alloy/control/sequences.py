"""The start sequences of ``alloy start`` (and the session test fixture): the cold or warm sequence of
:mod:`alloy.cluster.startup` with the Serve step bodies of :mod:`alloy.control.serve_ops` plugged in."""

from __future__ import annotations

from collections.abc import Callable

from ray.serve.schema import ServeDeploySchema

from alloy.cluster import startup
from alloy.cluster.recovery import Recovery
from alloy.cluster.startup import StartContext, StartSequence, StepBody
from alloy.components import BACKENDS, ENGINES
from alloy.control.nodes import cluster_gpu_count
from alloy.control.serve_deploy import deploy_serve_config
from alloy.control.serve_ops import apply_pool_snapshot, check_endpoints, current_pools, replay_dispatchers


def serve_start_sequence(
    mode: str,
    *,
    build_config: Callable[[], ServeDeploySchema],
    base_url: Callable[[], str],
    skip_dependency_checks: bool = False,
    gpu_count: Callable[[], float] | None = None,
    deploy_timeout_s: float = 600.0,
    recover: bool = True,
) -> StartSequence:
    """The cold (``mode="cold"``) or warm start of the specification with the Serve step bodies:

    - consistency check and repair (:class:`alloy.cluster.recovery.Recovery`) before any pool exists;
    - initialise (cold) or restore (warm: the persisted replica counts) the worker pools by deploying
      ``build_config()`` (a ``ServeDeploySchema``), then persist the pools as the next warm start's snapshot;
    - health checks: every component and the HTTP proxy at ``base_url()`` (warm: the engines and the proxy);
    - READY, then the interrupted jobs are replayed.

    ``recover=False`` leaves out the consistency check and the replay: a reload warm-starts a running cluster,
    whose active jobs are not interrupted. The caller provides a connected Ray driver and a
    :class:`StartContext` whose ``config`` is the ``ConfigHolder`` to start with."""

    def check_consistency(ctx: StartContext) -> str:
        recovery = Recovery(
            ctx["db"],
            ctx["store"],
            models=ctx["models"],
            state=ctx["cluster_state"],
            scratch_dirs=[ctx["settings"].merge_work_dir],
        )
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
        names = BACKENDS if ctx.mode == "cold" else ENGINES
        return check_endpoints(base_url(), names=names)

    def replay(ctx: StartContext) -> str:
        report = ctx["recovery"].replay(replay_dispatchers())
        ctx["replay"] = report
        return f"{len(report.dispatched)} jobs replayed, {len(report.failed)} failed"

    validate = startup.dependency_validation(gpu_count=gpu_count or cluster_gpu_count)
    if not recover:  # a reload: the running cluster's active jobs were never interrupted
        return _sequence(mode, validate, skip_dependency_checks, deploy_pools, health_check, None, None)
    return _sequence(mode, validate, skip_dependency_checks, deploy_pools, health_check, check_consistency, replay)


def _sequence(
    mode: str,
    validate: StepBody,
    skip_dependency_checks: bool,
    deploy_pools: StepBody,
    health_check: StepBody,
    check_consistency: StepBody | None,
    replay: StepBody | None,
) -> StartSequence:
    if mode == "cold":
        return startup.cold_start(
            load_configuration=startup.load_configuration,
            validate_dependencies=validate,
            connect_registries=startup.connect_registries,
            check_consistency=check_consistency,
            initialise_pools=deploy_pools,
            health_check=health_check,
            replay=replay,
        )
    if mode == "warm":
        return startup.warm_start(
            load_configuration=startup.load_configuration,
            connect_registries=startup.connect_registries,
            skip_dependency_checks=skip_dependency_checks,
            validate_dependencies=validate,
            check_consistency=check_consistency,
            restore_pools=deploy_pools,
            health_check=health_check,
            replay=replay,
        )
    raise ValueError(f"mode must be cold or warm, not {mode!r}")
