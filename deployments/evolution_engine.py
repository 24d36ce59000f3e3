"""EvolutionEngine deployment: a thin Ray Serve shell over :class:`evolution.engine.EvolutionService`.

``run_job`` is called by the ingress without awaiting: the evolution is an ongoing request of this replica (so
autoscaling counts it and a graceful shutdown drains it). The blocking search runs in a worker thread, so
``health`` stays answerable. The Tune driver runs inside the replica; trials are Ray actors on the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from ray import serve

from alloy.jobs.liveness import OrphanSweeper, heartbeat_interval
from alloy.jobs.store import JobKind
from deployments.runtime import open_services

logger = logging.getLogger("alloy.evolution_engine")

EVOLUTIONS_PER_REPLICA = 1  # a search already fans out over the cluster
SWEEP_INTERVAL_S = 30.0


@serve.deployment(name="EvolutionEngine", max_ongoing_requests=EVOLUTIONS_PER_REPLICA + 4,
                  graceful_shutdown_timeout_s=300, graceful_shutdown_wait_loop_s=2,
                  ray_actor_options={"num_cpus": 0.25})
class EvolutionEngine:
    def __init__(self, args: dict[str, Any]):
        from evolution.engine import EvolutionService

        self.args, self.services = open_services(args)
        s = self.services
        self.service = EvolutionService(s.settings, db=s.db, jobs=s.jobs, tracker=s.tracker, models=s.models,
                                        datasets=s.datasets, store=s.store,
                                        heartbeat_s=heartbeat_interval(self.args.job_stale_after_s))
        self._slots = threading.BoundedSemaphore(EVOLUTIONS_PER_REPLICA)
        self.running: set[str] = set()
        self.accepted: set[str] = set()  # queued for the slot or running: never "lost" while this replica lives
        # A replica that dies without its shutdown hook (node lost, force-killed) leaves its evolution RUNNING
        # with a stale heartbeat: any live replica requeues it and it resumes from its Tune checkpoints.
        self.sweeper = OrphanSweeper(
            s.jobs, JobKind.EVOLUTION, stale_after_s=self.args.job_stale_after_s,
            running_here=lambda: set(self.accepted), dispatch=self._dispatch, interval_s=SWEEP_INTERVAL_S,
        ).start()

    async def run_job(self, job_id: str) -> dict[str, Any]:
        work = asyncio.ensure_future(asyncio.to_thread(self._run_in_slot, job_id))
        while True:
            try:
                await asyncio.shield(work)
                record = self.service.jobs.get(job_id)
                return {"job_id": job_id, "state": record.state.value}
            except asyncio.CancelledError:
                if work.done():
                    raise
                logger.info("caller of evolution %s went away; the evolution continues", job_id)

    def _run_in_slot(self, job_id: str) -> dict[str, Any]:
        self.accepted.add(job_id)
        try:
            with self._slots:
                self.running.add(job_id)
                try:
                    return self.service.run_job(job_id)
                finally:
                    self.running.discard(job_id)
                    self.service.tracker.flush()
        finally:
            self.accepted.discard(job_id)

    def sweep(self) -> list[str]:
        """Requeue evolutions whose owner is gone and dispatch them again through this deployment's handle."""
        return self.sweeper.sweep()

    def _dispatch(self, job_id: str) -> None:
        serve.get_deployment_handle("EvolutionEngine", app_name=self.args.app_name).run_job.remote(job_id)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.service.cancel(job_id).model_dump(mode="json")

    def trials(self, job_id: str) -> list[dict[str, Any]]:
        return self.service.trials(job_id)

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "running_jobs": sorted(self.running)}

    def __del__(self):
        self.sweeper.stop()
        try:
            self.service.tracker.flush()
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass
