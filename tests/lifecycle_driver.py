"""A separate driver process for the real-process lifecycle tests (``python -m tests.lifecycle_driver PHASE
SPEC.json``), so that the pytest process never joins these Ray clusters (it may hold the session cluster).

Phases:
- ``submit``: start a Ray head, deploy the app, dispatch a merge job to the MergeEngine the way the ingress
  does (not awaited), wait until it is RUNNING, write the head's process id and exit, leaving the cluster
  running (the test then kills every process of it with SIGKILL);
- ``start``: start a new head and run the cold start of :mod:`alloy.startup` with the Serve step bodies of
  :mod:`alloy.cluster_ops` (consistency check before the pools, replay after READY), wait until the job is
  terminal, write the step log, then stop exactly this head.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = PROJECT_ROOT / "configs" / "serve.yaml"
TERMINAL = {"COMPLETED", "FAILED"}


def _settings(spec: dict[str, Any]):
    from alloy.config import Settings

    return Settings(**spec["settings"])


def _start_head(spec: dict[str, Any]):
    import ray

    from alloy.lifecycle import start_ray_head

    head = start_ray_head(spec["ray_temp_dir"], num_cpus=8)
    head.apply_env()
    ray.init(address=head.address, namespace="alloy-lifecycle", log_to_driver=False)
    return head


def _deploy(spec: dict[str, Any], head) -> str:
    from alloy import cluster_ops
    from alloy.lifecycle import deploy_serve_config, load_serve_config

    config = load_serve_config(SERVE_CONFIG, app_args={"settings": spec["settings"], "job_stale_after_s": 600},
                               http_port=head.http_port)
    # One engine replica each keeps the two-core test machine responsive.
    config = cluster_ops.apply_pool_snapshot(config, {"MergeEngine": 1, "EvaluationEngine": 1})
    deploy_serve_config(config, timeout_s=400)
    return f"http://127.0.0.1:{head.http_port}"


def _wait_state(jobs, job_id: str, states: set[str], timeout_s: float, poll_s: float = 0.02) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = jobs.get(job_id).state.value
        if state in states:
            return state
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} not in {states} after {timeout_s}s: {jobs.get(job_id).state.value}")


def submit(spec: dict[str, Any]) -> dict[str, Any]:
    from ray import serve

    from alloy.db import Database
    from alloy.jobs import JobStore

    head = _start_head(spec)
    out = {"head_pid": head.process.pid, "temp_dir": str(head.temp_dir)}
    Path(spec["result_path"]).write_text(json.dumps(out))  # written first: the test must always be able to kill it
    _deploy(spec, head)
    db = Database(_settings(spec).database_url)
    jobs = JobStore(db)
    serve.get_deployment_handle("MergeEngine", app_name="alloy").run_job.remote(spec["job_id"])
    out["seen"] = _wait_state(jobs, spec["job_id"], {"RUNNING", *TERMINAL}, timeout_s=240)
    Path(spec["result_path"]).write_text(json.dumps(out))
    os._exit(0)  # leave the cluster running exactly as it is (no ray.shutdown, no atexit hooks)


def start(spec: dict[str, Any]) -> dict[str, Any]:
    import ray

    from alloy import cluster_ops
    from alloy.config import ConfigHolder
    from alloy.dependencies import ray_gpu_count
    from alloy.lifecycle import stop_ray_head
    from alloy.recovery import Recovery
    from alloy.startup import StartContext, cold_start, connect_registries, dependency_validation, load_configuration

    head = _start_head(spec)
    result: dict[str, Any] = {}
    try:
        base_url = {}

        def check_consistency(ctx: StartContext) -> str:
            recovery = Recovery(ctx["db"], ctx["store"], models=ctx["models"], state=ctx["cluster_state"],
                                scratch_dirs=[Path(ctx["settings"].data_dir) / "work" / "merges"])
            report = recovery.check()
            result["consistency"] = report.model_dump(mode="json")
            ctx["recovery"] = recovery
            return recovery.repair(report).summary()

        def initialise_pools(ctx: StartContext) -> str:
            base_url["url"] = _deploy(spec, head)
            pools = cluster_ops.current_pools()
            ctx["cluster_state"].save_pool_snapshot(pools)
            return f"pools {pools}"

        def health_check(_ctx: StartContext) -> str:
            return cluster_ops.check_endpoints(base_url["url"])

        def replay(ctx: StartContext) -> str:
            report = ctx["recovery"].replay(cluster_ops.replay_dispatchers())
            return f"{len(report.dispatched)} replayed, {len(report.failed)} failed"

        ctx = StartContext(mode="cold", values={"config": ConfigHolder(_settings(spec))})
        run = cold_start(load_configuration=load_configuration,
                         validate_dependencies=dependency_validation(gpu_count=ray_gpu_count),
                         connect_registries=connect_registries, check_consistency=check_consistency,
                         initialise_pools=initialise_pools, health_check=health_check, replay=replay).run(ctx)
        result["start"] = run.model_dump(mode="json")
        from alloy.jobs import JobStore

        result["final_state"] = _wait_state(JobStore(ctx["db"]), spec["job_id"], TERMINAL, timeout_s=240, poll_s=0.5)
    finally:
        Path(spec["result_path"]).write_text(json.dumps(result))
        try:
            ray.shutdown()
        finally:
            stop_ray_head(head)
    return result


def stop(spec: dict[str, Any]) -> dict[str, Any]:
    """Start a head, deploy, dispatch the merge, wait until it RUNS, then run ``alloy stop``'s shutdown with
    ``spec["timeout_s"]``: the graceful wait either sees the merge finish or escalates to forced."""
    import ray
    from ray import serve

    from alloy import cluster_ops
    from alloy.cluster_state import ClusterStateStore
    from alloy.db import Database
    from alloy.jobs import JobStore
    from alloy.lifecycle import stop_ray_head
    from alloy.shutdown import Shutdown, ShutdownActions

    head = _start_head(spec)
    result: dict[str, Any] = {}
    try:
        _deploy(spec, head)
        db = Database(_settings(spec).database_url)
        jobs, state = JobStore(db), ClusterStateStore(db)
        state.begin_start("cold")
        state.mark_ready()
        serve.get_deployment_handle("MergeEngine", app_name="alloy").run_job.remote(spec["job_id"])
        result["seen"] = _wait_state(jobs, spec["job_id"], {"RUNNING", *TERMINAL}, timeout_s=240)
        terminated: dict[str, Any] = {}

        def flush() -> str:
            lsn = serve.get_deployment_handle("ExperimentTracker", app_name="alloy").flush.remote().result(
                timeout_s=30)
            return f"lsn {lsn}"

        def terminate() -> str:
            state.save_pool_snapshot(cluster_ops.current_pools())
            terminated["job_state_at_terminate"] = jobs.get(spec["job_id"]).state.value
            serve.shutdown()
            ray.shutdown()
            stop_ray_head(head)
            terminated["done"] = True
            return "serve shut down, ray head stopped"

        actions = ShutdownActions(
            cancel_active=lambda: cluster_ops.cancel_active_tasks(jobs),
            flush_tracker=flush, close_registries=lambda: (db.close(), "database closed")[1],
            terminate_pools=terminate)
        report = Shutdown(state, jobs, actions, timeout_s=spec["timeout_s"], poll_s=0.2).graceful()
        result.update(report=report.model_dump(mode="json"), **terminated,
                      final_job_state=jobs.get(spec["job_id"]).state.value, cluster=state.state().value)
    finally:
        Path(spec["result_path"]).write_text(json.dumps(result))
        if not result.get("done"):
            try:
                ray.shutdown()
            finally:
                stop_ray_head(head)
    return result


if __name__ == "__main__":
    phase, spec_path = sys.argv[1], sys.argv[2]
    {"submit": submit, "start": start, "stop": stop}[phase](json.loads(Path(spec_path).read_text()))
