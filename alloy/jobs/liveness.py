"""Who still owns a running job: a heartbeat kept by the owner, and a sweep that requeues jobs whose owner went
silent (a replica killed outright, a node lost) so that they are replayed instead of staying RUNNING forever.

Every job engine (merges, evolutions) uses the same three pieces: :class:`JobHeartbeat` while it runs a job,
:func:`sweep_orphans` to find lost jobs of its kind, and :class:`OrphanSweeper` to do that periodically in a
Serve replica and dispatch the lost jobs again. Dispatching twice is harmless: a run first claims its job
(CREATED -> PREPARING) and only one claim wins.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

from alloy.errors import AlloyError
from alloy.jobs.store import JobKind, JobRecord, JobState, JobStore

logger = logging.getLogger("alloy.jobs.liveness")


class JobHeartbeat:
    """Keeps ``progress.heartbeat_at`` (and so ``updated_at``) fresh while a job runs, so a sweeper can tell a
    live owner from a lost one even during long steps that report no progress (loading, evaluation)."""

    def __init__(self, jobs: JobStore, job_id: str, interval_s: float):
        self.jobs, self.job_id, self.interval_s = jobs, job_id, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and wait for a beat in flight, so the owner's next write (complete, fail) never races it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.jobs.update_progress(self.job_id, heartbeat_at=datetime.now(timezone.utc).isoformat())
            except AlloyError:
                return  # terminal or moved by someone else: nothing left to keep alive


def heartbeat_interval(stale_after_s: float) -> float:
    """Six beats per staleness window (1-10 s): one lost write never makes a live owner look dead."""
    return max(1.0, min(10.0, stale_after_s / 6))


def silent_for_s(job: JobRecord) -> float:
    """Seconds since the job's last write (progress, heartbeat or move)."""
    return (datetime.now(timezone.utc) - _aware(job.updated_at)).total_seconds()


def sweep_orphans(
    jobs: JobStore, *, kind: JobKind, stale_after_s: float, running_here: Iterable[str] = ()
) -> list[str]:
    """Requeue jobs of ``kind`` whose owner stopped beating (recording an ``interrupted`` event) and return every
    job id that should be dispatched again: those, plus CREATED jobs older than ``stale_after_s`` (a dispatch
    that was lost with its ingress)."""
    here = set(running_here)
    redispatch: list[str] = []
    for job in jobs.active(kind=kind):
        silent = silent_for_s(job)
        if job.id in here or silent < stale_after_s:
            continue
        if job.state is not JobState.CREATED:
            try:
                jobs.requeue(job.id, f"owner lost: no heartbeat for {silent:.0f}s")
            except AlloyError:
                continue  # someone else moved it first
        redispatch.append(job.id)
    return redispatch


class OrphanSweeper:
    """A daemon thread of a Serve replica: sweeps its kind's lost jobs soon after start (a replica replacing a
    dead one picks up its work at once), then every ``interval_s``, and hands each to ``dispatch``."""

    def __init__(
        self,
        jobs: JobStore,
        kind: JobKind,
        *,
        stale_after_s: float,
        running_here: Callable[[], Iterable[str]],
        dispatch: Callable[[str], None],
        interval_s: float = 30.0,
        first_after_s: float = 1.0,
    ):
        self.jobs, self.kind = jobs, kind
        self.stale_after_s = stale_after_s
        self.running_here = running_here
        self.dispatch = dispatch
        self.interval_s, self.first_after_s = interval_s, first_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{kind.value}-sweeper", daemon=True)

    def start(self) -> OrphanSweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def sweep(self) -> list[str]:
        job_ids = sweep_orphans(
            self.jobs, kind=self.kind, stale_after_s=self.stale_after_s, running_here=self.running_here()
        )
        for job_id in job_ids:
            logger.warning("replaying %s job %s: its owner is gone", self.kind.value, job_id)
            self.dispatch(job_id)
        return job_ids

    def _loop(self) -> None:
        wait = self.first_after_s
        while not self._stop.wait(wait):
            wait = self.interval_s
            try:
                self.sweep()
            except Exception:
                logger.exception("%s orphan sweep failed", self.kind.value)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
