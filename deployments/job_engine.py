"""What the three job engines (MergeEngine, EvaluationEngine, EvolutionEngine) share as Serve deployments.

A subclass opens its plain service, hands its :class:`alloy.jobs.skeleton.JobRunner` to :meth:`_start_jobs`, and
gets the same job handling as every other engine:

- ``run_job(job_id)`` is called by the ingress without awaiting it; the job then *is* an ongoing request of this
  replica (what Serve's autoscaler counts and a graceful shutdown drains). The blocking run is in a worker
  thread, shielded from the caller going away, so the event loop keeps answering ``health`` meanwhile;
- at most ``SLOTS`` jobs run at once per replica; the others wait inside it, still counted as load;
- a sweeper thread requeues jobs of its kind whose owner's lease lapsed (a replica killed outright, a node
  lost: ``job_stale_after_s``, 15 s, checked every ``job_sweep_interval_s``, 5 s; why a lease and not Ray's
  actor-death report: :mod:`alloy.jobs.liveness`), removes what the lost run left (the runner's
  ``clean_lost_run``) and re-dispatches them through this deployment's own handle;
- Serve's shutdown hook (``__del__``) drains: running jobs are cancelled and what does not stop is requeued.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from ray import serve

from alloy.jobs.liveness import heartbeat_interval
from alloy.jobs.skeleton import JobRunner, run_shielded
from deployments.runtime import AppArgs, Services, open_services

logger = logging.getLogger("alloy.engines")

# Serve replaces a replica that died only once its health check fails: checked every 2 s (Serve's default is
# 10 s), so that a killed engine replica is back, and its sweeper has requeued the lost job, within 30 s.
ENGINE_HEALTH_CHECK_S = 2.0
DRAIN_GRACE_S = 20.0  # after Serve's own graceful wait: how long cancelled jobs get to record themselves


class JobEngine:
    """Base of the job engine deployments; subclasses set the class variables and call :meth:`_start_jobs`."""

    COMPONENT: ClassVar[str]  # the deployment name (alloy.components), for self-dispatch
    SLOTS: ClassVar[int] = 1  # jobs running at once per replica

    args: AppArgs
    services: Services
    job_runner: JobRunner

    def _open(self, args: dict[str, Any]) -> None:
        self.args, self.services = open_services(args)

    @property
    def heartbeat_s(self) -> float:
        return heartbeat_interval(self.args.job_stale_after_s)

    def _start_jobs(self, job_runner: JobRunner) -> None:
        self.job_runner = job_runner
        job_runner.limit_slots(self.SLOTS)
        job_runner.start_sweeper(
            stale_after_s=self.args.job_stale_after_s,
            dispatch=self._dispatch,
            interval_s=self.args.job_sweep_interval_s,
        )

    async def run_job(self, job_id: str) -> dict[str, Any]:
        """Run job ``job_id`` to its end; returns its final state."""
        record = await run_shielded(lambda: self.job_runner.run(job_id), label=f"{self.COMPONENT} job {job_id}")
        return {"job_id": record.id, "state": record.state.value}

    def sweep(self) -> list[str]:
        """Requeue this kind's jobs whose owner is gone and dispatch them again through this deployment."""
        assert self.job_runner.sweeper is not None
        return self.job_runner.sweeper.sweep()

    def _dispatch(self, job_id: str) -> None:
        serve.get_deployment_handle(self.COMPONENT, app_name=self.args.app_name).run_job.remote(job_id)

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "running_jobs": sorted(self.job_runner.running)}

    def __del__(self) -> None:
        runner = getattr(self, "job_runner", None)
        if runner is None:
            return  # the constructor failed before any job could run
        interrupted = runner.drain(DRAIN_GRACE_S)
        if interrupted:
            logger.warning("%s replica shutdown interrupted jobs %s", self.COMPONENT, interrupted)
        if "tracker" in self.services.__dict__:  # opened: it may hold buffered writes
            try:
                self.services.tracker.flush()
            except Exception:
                logger.exception("tracker flush at shutdown failed")
