"""MergeEngine deployment: merge jobs (a thin shell over :class:`alloy.jobs.merge_runner.MergeJobRunner`).

Job handling (ongoing requests, slots, sweeper, shielded run, drain) is :class:`deployments.job_engine.JobEngine`'s.
Large merges (or those asking for ``parallelism``) are fanned out: this replica coordinates, groups of shards run
as Ray tasks on any node (:mod:`alloy.jobs.merge_fanout`, :mod:`alloy.control.merge_fanout`). A replica on a
node being drained starts no new merge: it hands the job back to the deployment.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from alloy import components as c
from alloy.control.merge_fanout import RayGroupLauncher
from alloy.control.nodes import this_node_draining
from alloy.evaluation.post_merge import evaluate_model_dir
from alloy.jobs.merge_fanout import FanoutCoordinator
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.merge_runner import MergeJobRunner
from deployments.job_engine import ENGINE_HEALTH_CHECK_S, JobEngine

MERGES_PER_REPLICA = 2
HANDOFF_DELAY_S = 1.0  # Serve moves replicas off a draining node within seconds; until then jobs bounce


@serve.deployment(
    name=c.MERGE_ENGINE,
    # Merges beyond the slots wait inside the replica: they still count as load for autoscaling, and the spare
    # request slots keep health() reachable while every merge slot is busy.
    max_ongoing_requests=MERGES_PER_REPLICA + 4,
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=2,
    health_check_period_s=ENGINE_HEALTH_CHECK_S,
    ray_actor_options={"num_cpus": 0.5},
)
class MergeEngineDeployment(JobEngine):
    COMPONENT = c.MERGE_ENGINE
    SLOTS = MERGES_PER_REPLICA

    def __init__(self, args: dict[str, Any]):
        self._open(args)
        settings = self.services.settings
        torch.set_num_threads(settings.merge.threads)  # per-tensor work is already spread over merge slots
        self.runner = MergeJobRunner(
            self.services.jobs,
            self.services.models,
            settings.merge_work_dir,
            device=settings.merge.device,
            shard_bytes=settings.merge.shard_bytes,
            max_in_flight=settings.merge.max_in_flight,
            evaluate=self._evaluate,
            heartbeat_s=self.heartbeat_s,
            cache_bytes=settings.merge.cache_bytes,
            fanout=FanoutCoordinator(
                self.services.models,
                RayGroupLauncher.for_settings(self.args.load_settings, settings),
                settings.merge,
                settings.merge_work_dir,
            ),
            node=ray.get_runtime_context().get_node_id(),
        )
        self.runner.clean_work_dir()  # what lost runs of earlier replicas on this node left
        self._start_jobs(self.runner.job_runner)

    async def run_job(self, job_id: str) -> dict[str, Any]:
        """Run the job here, unless this node is being drained (``POST /admin/drain``): then nothing new starts
        here and the job goes back to the deployment, whose other replicas (or the replacement Serve starts on
        another node) take it."""
        if await asyncio.to_thread(this_node_draining):
            await asyncio.sleep(HANDOFF_DELAY_S)
            self._dispatch(job_id)
            return {"job_id": job_id, "state": "CREATED", "handed_off": True}
        return await super().run_job(job_id)

    def _evaluate(self, model_dir: Path, request: MergeRequest) -> dict[str, Any]:
        """In-process evaluation of the merged folder (it is local to this replica until registered)."""
        assert request.evaluate is not None
        return evaluate_model_dir(
            model_dir,
            request.evaluate.datasets,
            request.evaluate.split,
            datasets=self.services.datasets,
            db=self.services.db,
            model_id=request.output_model_id,
        )

    def health(self) -> dict[str, Any]:
        return {**super().health(), "cache": self.cache_stats(), "node": self.runner.node}

    def cache_stats(self) -> dict[str, Any]:
        return self.runner.cache.stats().model_dump()

    def clear_cache(self) -> dict[str, Any]:
        dropped = self.runner.cache.clear()
        return {"dropped": dropped, **self.cache_stats()}
