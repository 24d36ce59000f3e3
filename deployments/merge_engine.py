"""MergeEngine deployment: merge jobs (a thin shell over :class:`alloy.jobs.merge_runner.MergeJobRunner`).

Job handling (ongoing requests, slots, sweeper, shielded run, drain) is :class:`deployments.job_engine.JobEngine`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from ray import serve

from alloy import components as c
from alloy.evaluation import evaluate_model_dir
from alloy.jobs.merge_request import MergeRequest
from alloy.jobs.merge_runner import MergeJobRunner
from deployments.job_engine import ENGINE_HEALTH_CHECK_S, JobEngine

MERGES_PER_REPLICA = 2


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
        )
        self.runner.clean_work_dir()  # what lost runs of earlier replicas on this node left
        self._start_jobs(self.runner.job_runner)

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
        return {**super().health(), "cache": self.cache_stats()}

    def cache_stats(self) -> dict[str, Any]:
        return self.runner.cache.stats().model_dump()

    def clear_cache(self) -> dict[str, Any]:
        dropped = self.runner.cache.clear()
        return {"dropped": dropped, **self.cache_stats()}
