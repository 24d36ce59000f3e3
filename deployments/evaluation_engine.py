"""EvaluationEngine deployment: a thin Ray Serve shell over :class:`alloy.evaluation.EvaluationService`.

Job handling (ongoing requests, slots, sweeper, shielded run, drain) is :class:`deployments.job_engine.JobEngine`'s.
Scoring is CPU-bound: one evaluation at a time per replica (synchronous ``evaluate`` calls take the same slot),
so ``health`` and ``cache_stats`` stay answerable meanwhile. Resources come from the serve config.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from alloy import components as c
from alloy.evaluation.service import EvaluationService, configure_threads
from deployments.job_engine import ENGINE_HEALTH_CHECK_S, JobEngine

EVALUATIONS_PER_REPLICA = 1


@serve.deployment(
    name=c.EVALUATION_ENGINE,
    max_ongoing_requests=EVALUATIONS_PER_REPLICA + 4,
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=2,
    health_check_period_s=ENGINE_HEALTH_CHECK_S,
)
class EvaluationEngine(JobEngine):
    COMPONENT = c.EVALUATION_ENGINE
    SLOTS = EVALUATIONS_PER_REPLICA

    def __init__(self, args: dict[str, Any]):
        self._open(args)
        settings = self.services.settings.evaluation
        configure_threads(settings.threads)
        self.service = EvaluationService(
            self.services.models,
            self.services.datasets,
            self.services.tracker,
            self.services.jobs,
            self.services.store,
            cache_capacity=settings.cache_models,
            batch_size=settings.batch_size,
            heartbeat_s=self.heartbeat_s,
        )
        self._start_jobs(self.service.job_runner)

    async def evaluate(
        self,
        model_id: str,
        datasets: list[str],
        split: str = "test",
        batch_size: int | None = None,
        experiment_id: str | None = None,
    ) -> list[dict[str, Any]]:
        """Synchronous evaluation of a registered model; EvalResult dicts."""

        def work() -> list[dict[str, Any]]:
            with self.job_runner.slot():
                results = self.service.evaluate_model(model_id, datasets, split, batch_size, experiment_id)
            return [r.model_dump() for r in results]

        return await asyncio.to_thread(work)

    def health(self) -> dict[str, Any]:
        return {**super().health(), "cache": self.cache_stats()}

    def cache_stats(self) -> dict[str, Any]:
        return self.service.cache_stats()

    def clear_cache(self) -> dict[str, Any]:
        dropped = self.service.clear_cache()
        return {"dropped": dropped, **self.service.cache_stats()}
