"""EvolutionEngine deployment: a thin Ray Serve shell over :class:`evolution.engine.EvolutionService`.

Job handling (ongoing requests, slots, sweeper, shielded run, drain) is :class:`deployments.job_engine.JobEngine`'s.
The Tune driver runs inside the replica; trials are Ray actors on the cluster. A replica that dies leaves its
evolution RUNNING with a stale heartbeat: any live replica's sweeper requeues it and it resumes from its Tune
checkpoints.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from alloy import components as c
from deployments.job_engine import ENGINE_HEALTH_CHECK_S, JobEngine
from evolution.engine import EvolutionService

EVOLUTIONS_PER_REPLICA = 1  # a search already fans out over the cluster


@serve.deployment(
    name=c.EVOLUTION_ENGINE,
    max_ongoing_requests=EVOLUTIONS_PER_REPLICA + 4,
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=2,
    health_check_period_s=ENGINE_HEALTH_CHECK_S,
    ray_actor_options={"num_cpus": 0.25},
)
class EvolutionEngine(JobEngine):
    COMPONENT = c.EVOLUTION_ENGINE
    SLOTS = EVOLUTIONS_PER_REPLICA

    def __init__(self, args: dict[str, Any]):
        self._open(args)
        s = self.services
        self.service = EvolutionService(
            s.settings,
            db=s.db,
            jobs=s.jobs,
            tracker=s.tracker,
            models=s.models,
            datasets=s.datasets,
            store=s.store,
            heartbeat_s=self.heartbeat_s,
        )
        self._start_jobs(self.service.job_runner)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.service.cancel(job_id).model_dump(mode="json")

    def trials(self, job_id: str) -> list[dict[str, Any]]:
        return self.service.trials(job_id)

    def promote(self, job_id: str, candidate_id: str, model_id: str) -> dict[str, Any]:
        return self.service.promote(job_id, candidate_id, model_id)
