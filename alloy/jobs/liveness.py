"""Who still owns a running job: a short lease kept by its owner (a heartbeat in the job record), and a sweep
that requeues jobs whose lease lapsed (a replica killed outright, a node lost, a batch driver gone) so that they
are replayed instead of staying RUNNING forever.

Why a lease, and not Ray's report that an actor died: every owner of a job writes the job store, whatever it
is (a Serve replica, the ``python -m evolution.run`` driver, which is no actor), so a lease in the job record
covers them all and keeps ``alloy.jobs`` Ray-free. Ray reports an actor dead only when its process or node is
gone: a replica that is alive but stuck (a deadlock, a hung filesystem) would hold its job forever, a node cut
off by the network is reported only after Ray's own health-check timeout, and listening for the report needs
a controller subscribed to the GCS plus each job's actor id. The lease costs one small UPDATE per running job
every few seconds and one query of the active jobs per sweep.

Timing: a lost job is requeued at most ``lease_s + sweep_s`` after its owner's last beat (15 s + 5 s by
default: within 30 s of the death) and dispatched again at once. A live owner whose lease lapsed anyway (a long
stall of its process or of the database) is *fenced*: its next beat finds the job at another attempt and
cancels its run, which then gives the job up without touching it, so two runs never both finish one job.

Every engine (merges, evaluations, evolutions) uses the same pieces: :class:`JobHeartbeat` while it runs a
job, :func:`requeue_lost` (one interruption is one attempt; the lost run's leftovers are removed), and
:class:`OrphanSweeper`, which sweeps its kind's lost jobs periodically and dispatches them again. Dispatching
twice is harmless: a run first claims its job (CREATED -> PREPARING) and only one claim wins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

from alloy.errors import AlloyError
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.store import JobStore

logger = logging.getLogger("alloy.jobs.liveness")

DEFAULT_LEASE_S = 15.0  # a job whose owner wrote nothing for this long is lost
DEFAULT_SWEEP_S = 5.0  # how often each engine replica looks for lost jobs
LOST_DISPATCH_AFTER_S = 60.0  # a CREATED job nobody claimed for this long: its dispatch was lost (at least)

# The states a runner holds its job in (CREATED -> PREPARING is how it takes ownership).
HELD_STATES = frozenset({JobState.PREPARING, JobState.RUNNING, JobState.EVALUATING})

# Removes what a lost run of a job left behind (scratch and staging folders, an output it registered but never
# completed); called with the job's record just after it was requeued.
CleanLostRun = Callable[[JobRecord], None]


class JobHeartbeat:
    """Keeps ``progress.heartbeat_at`` (and so ``updated_at``) fresh while a job runs, so a sweeper can tell a
    live owner from a lost one even during long steps that report no progress (loading, evaluation). When the
    job is found moved by someone else (requeued: another attempt; or ended), it calls ``on_lost`` and stops."""

    def __init__(
        self,
        jobs: JobStore,
        job_id: str,
        interval_s: float,
        *,
        attempt: int | None = None,
        on_lost: Callable[[], None] | None = None,
    ):
        self.jobs, self.job_id, self.interval_s = jobs, job_id, interval_s
        self.attempt, self.on_lost = attempt, on_lost
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
                current = self.jobs.get(self.job_id)
                if self.attempt is not None and (current.attempts != self.attempt or current.state not in HELD_STATES):
                    self._lost()
                    return
                self.jobs.update_progress(self.job_id, heartbeat_at=datetime.now(timezone.utc).isoformat())
            except AlloyError:
                self._lost()  # ended or moved by someone else: nothing left to keep alive
                return
            except Exception:  # a database hiccup: the next beat tries again
                logger.warning("heartbeat of job %s not written", self.job_id, exc_info=True)

    def _lost(self) -> None:
        if self.on_lost is not None and not self._stop.is_set():
            self.on_lost()


def heartbeat_interval(lease_s: float) -> float:
    """Six beats per lease (0.5-10 s): a few lost writes never make a live owner look dead."""
    return max(0.5, min(10.0, lease_s / 6))


DEFAULT_HEARTBEAT_S = heartbeat_interval(DEFAULT_LEASE_S)


def silent_for_s(job: JobRecord) -> float:
    """Seconds since the job's last write (progress, heartbeat or move)."""
    return (datetime.now(timezone.utc) - _aware(job.updated_at)).total_seconds()


def requeue_lost(jobs: JobStore, job: JobRecord, reason: str, clean: CleanLostRun | None = None) -> JobRecord | None:
    """Requeue ``job`` as seen in ``job`` (a run held it and is gone), once: a CREATED job is already queued
    (nothing was interrupted) and a job someone else requeued or moved meanwhile is left alone, so one
    interruption counts one attempt. Then ``clean`` removes what the lost run left. None when nothing was done."""
    if job.state not in HELD_STATES:
        return None
    try:
        record = jobs.requeue(job.id, reason, attempt=job.attempts)
    except AlloyError:
        return None  # someone else moved it first
    if clean is not None:
        try:
            clean(record)
        except Exception:  # leftovers are also removed at the next start; the job must go on
            logger.exception("cleaning up after the lost run of job %s failed", job.id)
    return record


def sweep_orphans(
    jobs: JobStore,
    *,
    kind: JobKind,
    stale_after_s: float,
    running_here: Iterable[str] = (),
    clean: CleanLostRun | None = None,
    lost_dispatch_after_s: float | None = None,
    dispatched_recently: Iterable[str] = (),
) -> list[str]:
    """Requeue jobs of ``kind`` whose owner's lease lapsed (recording an ``interrupted`` event; ``clean``
    removes the lost run's leftovers) and return every job id that should be dispatched again: those, plus
    CREATED jobs silent for ``lost_dispatch_after_s`` (default: the lease; a dispatch lost with its caller)
    that are not among ``dispatched_recently``."""
    here = set(running_here)
    created_after = stale_after_s if lost_dispatch_after_s is None else lost_dispatch_after_s
    recent = set(dispatched_recently)
    redispatch: list[str] = []
    for job in jobs.active(kind=kind):
        if job.id in here:
            continue
        silent = silent_for_s(job)
        if job.state is JobState.CREATED:
            if silent >= created_after and job.id not in recent:
                redispatch.append(job.id)
            continue
        if silent < stale_after_s:
            continue
        if requeue_lost(jobs, job, f"owner lost: no heartbeat for {silent:.0f}s", clean) is not None:
            redispatch.append(job.id)
    return redispatch


class OrphanSweeper:
    """A daemon thread of a Serve replica: sweeps its kind's lost jobs soon after start (a replica replacing a
    dead one picks up its work at once), then every ``interval_s``, and hands each to ``dispatch``. A CREATED
    job it dispatched is not dispatched again for ``LOST_DISPATCH_AFTER_S`` (it may wait in a queue)."""

    def __init__(
        self,
        jobs: JobStore,
        kind: JobKind,
        *,
        stale_after_s: float,
        running_here: Callable[[], Iterable[str]],
        dispatch: Callable[[str], None],
        interval_s: float = DEFAULT_SWEEP_S,
        first_after_s: float = 1.0,
        clean: CleanLostRun | None = None,
    ):
        self.jobs, self.kind = jobs, kind
        self.stale_after_s = stale_after_s
        self.running_here = running_here
        self.dispatch = dispatch
        self.interval_s, self.first_after_s = interval_s, first_after_s
        self.clean = clean
        self._dispatched: dict[str, float] = {}  # job id -> when this sweeper last dispatched it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{kind.value}-sweeper", daemon=True)

    def start(self) -> OrphanSweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def sweep(self) -> list[str]:
        now = time.monotonic()
        recent = {job_id for job_id, at in self._dispatched.items() if now - at < LOST_DISPATCH_AFTER_S}
        self._dispatched = {job_id: self._dispatched[job_id] for job_id in recent}
        job_ids = sweep_orphans(
            self.jobs,
            kind=self.kind,
            stale_after_s=self.stale_after_s,
            running_here=self.running_here(),
            clean=self.clean,
            lost_dispatch_after_s=max(self.stale_after_s, LOST_DISPATCH_AFTER_S),
            dispatched_recently=recent,
        )
        for job_id in job_ids:
            logger.warning("replaying %s job %s: its owner is gone", self.kind.value, job_id)
            self._dispatched[job_id] = now
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
