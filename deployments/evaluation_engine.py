"""EvaluationEngine deployment: a thin Ray Serve shell over :class:`alloy.evaluation.EvaluationService`.

``run_job(job_id)`` is called by the ingress without awaiting it; the evaluation then *is* an ongoing request of
this replica (autoscaling counts it, a graceful shutdown drains it). Scoring is CPU-bound and runs in a worker
thread, one evaluation at a time per replica, so ``health`` and ``cache_stats`` stay answerable meanwhile.
Resources (CPUs, replicas) come from the serve config, not from this file.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from ray import serve

from deployments.runtime import open_services

logger = logging.getLogger("alloy.evaluation_engine")

EVALUATIONS_PER_REPLICA = 1


@serve.deployment(name="EvaluationEngine", max_ongoing_requests=EVALUATIONS_PER_REPLICA + 4,
                  graceful_shutdown_timeout_s=300, graceful_shutdown_wait_loop_s=2)
class EvaluationEngine:
    def __init__(self, args: dict[str, Any]):
        from alloy.evaluation.service import EvaluationService, configure_threads

        self.args, self.services = open_services(args)
        settings = self.services.settings.evaluation
        configure_threads(settings.threads)
        self.service = EvaluationService(
            self.services.models, self.services.datasets, self.services.tracker, self.services.jobs,
            self.services.store, cache_capacity=settings.cache_models, batch_size=settings.batch_size,
        )
        self._slots = threading.BoundedSemaphore(EVALUATIONS_PER_REPLICA)
        self._running: set[str] = set()

    async def run_job(self, job_id: str) -> dict[str, Any]:
        """Run evaluation job ``job_id`` (CREATED -> ... -> COMPLETED/FAILED); returns its final state."""
        record = await asyncio.to_thread(self._run_in_slot, job_id)
        return {"job_id": record.id, "state": record.state.value}

    def _run_in_slot(self, job_id: str):
        with self._slots:
            self._running.add(job_id)
            try:
                return self.service.run_job(job_id)
            finally:
                self._running.discard(job_id)

    async def evaluate(self, model_id: str, datasets: list[str], split: str = "test",
                       batch_size: int | None = None, experiment_id: str | None = None) -> list[dict[str, Any]]:
        """Synchronous evaluation of a registered model; EvalResult dicts."""
        def work():
            with self._slots:
                return self.service.evaluate_model(model_id, datasets, split, batch_size, experiment_id)

        return [r.model_dump() for r in await asyncio.to_thread(work)]

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "running_jobs": sorted(self._running), "cache": self.cache_stats()}

    def cache_stats(self) -> dict[str, Any]:
        return self.service.cache_stats()

    def clear_cache(self) -> dict[str, Any]:
        dropped = self.service.clear_cache()
        return {"dropped": dropped, **self.service.cache_stats()}

    def __del__(self):
        # A shutdown that outlived the graceful wait: record the interruption so the job can be replayed.
        for job_id in list(getattr(self, "_running", ())):
            try:
                self.services.jobs.requeue(job_id, "replica shut down during the evaluation")
            except Exception:  # noqa: BLE001 - best effort during teardown; logged
                logger.exception("could not requeue evaluation job %s", job_id)
        try:
            self.services.tracker.flush()
        except Exception:  # noqa: BLE001
            logger.exception("tracker flush at shutdown failed")
