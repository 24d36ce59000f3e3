"""MergeEngine deployment: runs merge jobs as ongoing requests (a thin shell over :class:`MergeJobRunner`).

``run_job(job_id)`` is called by the ingress without awaiting it. The merge then *is* an ongoing request of this
replica, which is what Serve's autoscaler counts (``target_ongoing_requests``) and what a graceful shutdown
drains (``graceful_shutdown_timeout_s``). The blocking merge runs in a worker thread, so the replica's event loop
keeps answering health checks and progress-free calls (``health``, ``cache_stats``) while it works.

Interruptions are recorded, never silent: ``__del__`` (Serve's shutdown hook) cancels running merges, which
requeue themselves with an ``interrupted`` event; a replica killed outright (node loss, force-kill after the
graceful timeout) stops beating, and the sweeper of any live replica requeues and re-dispatches its jobs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ray import serve

from alloy.jobs.liveness import OrphanSweeper, heartbeat_interval
from alloy.jobs.store import JobKind
from alloy.jobs.merge import MergeJobRunner
from deployments.runtime import open_services

logger = logging.getLogger("alloy.merge_engine")

MERGES_PER_REPLICA = 2
SWEEP_INTERVAL_S = 30.0


@serve.deployment(
    name="MergeEngine",
    # Merges beyond the slots below wait inside the replica: they still count as load for autoscaling, and
    # the spare request slots keep health() reachable while every merge slot is busy.
    max_ongoing_requests=MERGES_PER_REPLICA + 4,
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=2,
    ray_actor_options={"num_cpus": 0.5},
)
class MergeEngineDeployment:
    def __init__(self, args: dict[str, Any]):
        import torch

        self.args, self.services = open_services(args)
        settings = self.services.settings
        torch.set_num_threads(settings.merge.threads)  # per-tensor work is already spread over merge slots
        self.runner = MergeJobRunner(
            self.services.jobs,
            self.services.models,
            Path(settings.data_dir).resolve() / "work" / "merges",
            device=settings.merge.device,
            shard_bytes=settings.merge.shard_bytes,
            max_in_flight=settings.merge.max_in_flight,
            evaluate=self._evaluator(),
            heartbeat_s=heartbeat_interval(self.args.job_stale_after_s),
            cache_bytes=settings.merge.cache_bytes,
        )
        self._slots = threading.BoundedSemaphore(MERGES_PER_REPLICA)
        self.accepted: set[str] = set()  # every job this replica holds, queued for a slot or running
        self.sweeper = OrphanSweeper(
            self.services.jobs, JobKind.MERGE, stale_after_s=self.args.job_stale_after_s,
            running_here=lambda: set(self.accepted), dispatch=self._dispatch, interval_s=SWEEP_INTERVAL_S,
        ).start()

    def _evaluator(self):
        """In-process evaluation of the merged folder (it is local to this replica until registered)."""
        from alloy.evaluation import evaluate_model_dir

        db, datasets = self.services.db, self.services.datasets

        def evaluate(model_dir: Path, request) -> dict[str, Any]:
            return evaluate_model_dir(model_dir, request.evaluate.datasets, request.evaluate.split,
                                      datasets=datasets, db=db, model_id=request.output_model_id)

        return evaluate

    async def run_job(self, job_id: str) -> dict[str, Any]:
        cancel = threading.Event()
        merge = asyncio.ensure_future(asyncio.to_thread(self._run_in_slot, job_id, cancel))
        while True:
            try:
                record = await asyncio.shield(merge)
                return {"job_id": record.id, "state": record.state.value}
            except asyncio.CancelledError:
                if merge.done():
                    raise
                # The caller went away (an ingress replica restarted, a client disconnected). The job belongs
                # to this replica, not to the caller: keep it running *as this request*, so it stays visible
                # to autoscaling and a shutdown still drains it.
                logger.info("caller of merge job %s went away; the merge continues", job_id)

    def _run_in_slot(self, job_id: str, cancel: threading.Event):
        self.accepted.add(job_id)  # waiting for a slot is not lost: the sweeper must not dispatch it again
        try:
            with self._slots:
                return self.runner.run(job_id, cancel)
        finally:
            self.accepted.discard(job_id)

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "running_jobs": sorted(self.runner.running), "cache": self.cache_stats()}

    def cache_stats(self) -> dict[str, Any]:
        return self.runner.cache.stats().model_dump()

    def clear_cache(self) -> dict[str, Any]:
        return self.runner.cache.clear().model_dump()

    # -- recovery --------------------------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Requeue jobs whose owner is gone and dispatch them again through this deployment's handle."""
        return self.sweeper.sweep()

    def _dispatch(self, job_id: str) -> None:
        serve.get_deployment_handle("MergeEngine", app_name=self.args.app_name).run_job.remote(job_id)

    def __del__(self):
        self.sweeper.stop()
        interrupted = self.runner.interrupt_all()
        deadline = time.monotonic() + 20
        while self.runner.running and time.monotonic() < deadline:
            time.sleep(0.2)
        for job_id in list(self.runner.running):  # a merge that ignored the cancel: record it ourselves
            try:
                self.services.jobs.requeue(job_id, "replica shut down during the merge")
            except Exception:  # noqa: BLE001
                logger.exception("could not requeue %s", job_id)
        if interrupted:
            logger.warning("replica shutdown interrupted merge jobs %s", interrupted)
