"""The one way a job is run, whatever its kind (merge, evaluation, evolution); plain Python, no Ray.

A job body (``JobBody``) does the kind's own work and returns the job's result. :class:`JobRunner` wraps every
body in the same skeleton:

- **accepted + slot**: the job is "held here" from the moment it is accepted, also while it waits for one of the
  replica's slots (a bounded semaphore), so a sweeper never dispatches it a second time;
- **claim**: CREATED -> PREPARING; only one of several dispatches of the same job wins, the others return;
- **heartbeat** (a short lease, :mod:`alloy.jobs.liveness`) while the body runs, so a sweeper can tell a live
  owner from a lost one; a beat that finds the job moved by someone else cancels the run (fencing);
- **endings**: the body's result -> COMPLETED; an :class:`AlloyError` -> FAILED with its code; any other crash
  -> FAILED ``INTERNAL_ERROR``; a cancel (:class:`JobInterrupted`) -> requeued with an ``interrupted`` event;
  a job moved by someone else meanwhile (a forced stop, a sweeper) is left as it is ("abandoned"). Every ending
  is written for the run's own attempt only, so a run that lost its job can never end the next attempt;
- **undo**: what the body registered with :meth:`JobRun.on_undo` is undone unless the job COMPLETED, and what it
  registered with :meth:`JobRun.on_exit` always runs;
- **sweeper** (:meth:`JobRunner.start_sweeper`) requeues its kind's lost jobs (``clean_lost_run`` removes
  what the lost run left: scratch, staging, an output it registered) and hands them to ``dispatch``;
- **drain** (:meth:`JobRunner.drain`): the shutdown hook cancels every running job, waits, and requeues what
  did not stop.

:func:`run_shielded` is the async side: the blocking run in a worker thread as the caller's coroutine, kept
running (and awaited) when the caller goes away, so it stays an ongoing request of its replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.liveness import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_SWEEP_S,
    HELD_STATES,
    CleanLostRun,
    JobHeartbeat,
    OrphanSweeper,
    requeue_lost,
)
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.store import JobStore

logger = logging.getLogger("alloy.jobs")

T = TypeVar("T")

RUNNER_STATES = HELD_STATES  # the states a runner holds its job in (CREATED -> PREPARING takes ownership)


class JobInterrupted(Exception):
    """Raised inside a body when its run's cancel event is set (replica shutting down)."""


@dataclass
class JobRun:
    """What a body sees of its run: the claimed record, the store, the cancel event and the undo hooks."""

    jobs: JobStore
    record: JobRecord
    cancel: threading.Event
    lost: threading.Event = field(default_factory=threading.Event)  # set (with cancel) when the run is fenced
    _undo: list[Callable[[], None]] = field(default_factory=list)
    _exit: list[Callable[[], object]] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return self.record.id

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise JobInterrupted()

    @property
    def attempt(self) -> int:
        return self.record.attempts

    def transition(self, state: JobState, **fields: Any) -> JobRecord:
        """Move this run's job (CONFLICT once someone else requeued it: the run then stops as abandoned)."""
        return self.jobs.transition(self.job_id, state, attempt=self.attempt, **fields)

    def on_undo(self, action: Callable[[], None]) -> None:
        """Run ``action`` if the job does not end COMPLETED (e.g. unregister an output registered early)."""
        self._undo.append(action)

    def on_exit(self, action: Callable[[], object]) -> None:
        """Run ``action`` however the run ends (e.g. remove a scratch folder)."""
        self._exit.append(action)


JobBody = Callable[[JobRun], dict[str, Any]]


class JobRunner:
    """Runs jobs of one kind through ``body``; thread-safe (one :meth:`run` per thread)."""

    def __init__(
        self,
        jobs: JobStore,
        kind: JobKind,
        body: JobBody,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        claim_progress: dict[str, Any] | None = None,
        slots: int = 0,
        clean_lost_run: CleanLostRun | None = None,
    ):
        self.jobs, self.kind, self.body = jobs, kind, body
        self.heartbeat_s = heartbeat_s
        self.clean_lost_run = clean_lost_run
        self.claim_progress = claim_progress or {"stage": "preparing"}
        self.running: dict[str, threading.Event] = {}  # job id -> its cancel event
        self._attempts: dict[str, int] = {}  # job id -> the attempt this runner holds
        self.accepted: set[str] = set()  # queued for a slot or running: held by this runner
        self.sweeper: OrphanSweeper | None = None
        self._slots: threading.BoundedSemaphore | None = None
        self._lock = threading.Lock()
        self.limit_slots(slots)

    def limit_slots(self, slots: int) -> None:
        """At most ``slots`` jobs run at once (0: no limit); the others wait, still accepted."""
        self._slots = threading.BoundedSemaphore(slots) if slots > 0 else None

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of the slots, for jobs and for synchronous work that competes with them."""
        if self._slots is None:
            yield
            return
        with self._slots:
            yield

    # -- running ------------------------------------------------------------------------------------------
    def run(self, job_id: str, cancel: threading.Event | None = None) -> JobRecord:
        """Run job ``job_id`` to its end and return its record; never raises for a job-level failure."""
        with self._lock:
            self.accepted.add(job_id)
        try:
            with self.slot():
                return self._run_claimed(job_id, cancel or threading.Event())
        finally:
            with self._lock:
                self.accepted.discard(job_id)

    def _run_claimed(self, job_id: str, cancel: threading.Event) -> JobRecord:
        record = self._claim(job_id)
        if record is None:  # someone else owns it, or it already ended: nothing to do
            return self.jobs.get(job_id)
        with self._lock:
            self.running[job_id] = cancel
            self._attempts[job_id] = record.attempts
        run = JobRun(self.jobs, record, cancel)
        attempt = record.attempts
        heartbeat = JobHeartbeat(self.jobs, job_id, self.heartbeat_s, attempt=attempt, on_lost=lambda: self._fence(run))
        completed = False
        try:
            heartbeat.start()
            result = self.body(run)
            heartbeat.stop()
            done = self.jobs.complete(job_id, result, attempt=attempt)
            completed = True
            return done
        except JobInterrupted:
            if self._lost_ownership(run):
                return self._abandoned(run)
            reason = f"replica shutting down: {self.kind.value} job interrupted"
            return self._end(run, lambda: self.jobs.requeue(job_id, reason, attempt=attempt))
        except AlloyError as exc:
            if self._lost_ownership(run):
                return self._abandoned(run)
            code, message = exc.code, exc.message
            return self._end(run, lambda: self.jobs.fail(job_id, code, message, attempt=attempt))
        except Exception as exc:
            if self._lost_ownership(run):
                return self._abandoned(run)
            logger.exception("%s job %s crashed", self.kind.value, job_id)
            message = f"{self.kind.value} failed: {type(exc).__name__}: {exc}"
            return self._end(run, lambda: self.jobs.fail(job_id, ErrorCode.INTERNAL_ERROR, message, attempt=attempt))
        finally:
            heartbeat.stop()
            with self._lock:
                self.running.pop(job_id, None)
                self._attempts.pop(job_id, None)
            if not completed:
                _run_all(run._undo, "undo", job_id)
            _run_all(run._exit, "exit", job_id)

    def _claim(self, job_id: str) -> JobRecord | None:
        try:
            return self.jobs.transition(job_id, JobState.PREPARING, progress=dict(self.claim_progress))
        except AlloyError as exc:
            if exc.code is ErrorCode.CONFLICT:
                return None
            raise

    def _end(self, run: JobRun, move: Callable[[], JobRecord]) -> JobRecord:
        """Record the ending; a job already terminal (or requeued by a sweeper) is left as it is."""
        try:
            return move()
        except AlloyError:
            return self.jobs.get(run.job_id)

    def _fence(self, run: JobRun) -> None:
        """The heartbeat found the job moved by someone else (its lease lapsed and a sweeper requeued it, or a
        forced stop did): stop this run at its next cancel point; it then gives the job up."""
        logger.warning("%s job %s: this run lost its lease; stopping it", self.kind.value, run.job_id)
        run.lost.set()
        run.cancel.set()

    def _lost_ownership(self, run: JobRun) -> bool:
        """Whether someone else moved the job while this run held it: requeued (a forced stop, a sweeper, the
        start-time recovery) or ended. Then the job is no longer this run's to finish or to fail."""
        current = self.jobs.get(run.job_id)
        return current.attempts != run.record.attempts or current.state not in RUNNER_STATES

    def _abandoned(self, run: JobRun) -> JobRecord:
        """Give the job up without touching its record: failing it would be legal from CREATED and would end a
        requeued job FAILED. The undo hooks still remove this run's own outputs."""
        logger.warning(
            "%s job %s was moved by someone else while it ran: leaving it as it is", self.kind.value, run.job_id
        )
        return self.jobs.get(run.job_id)

    # -- shutdown and recovery ----------------------------------------------------------------------------
    def interrupt_all(self) -> list[str]:
        """Cancel every job this runner is executing; each records itself as interrupted."""
        with self._lock:
            events = dict(self.running)
        for event in events.values():
            event.set()
        return list(events)

    def drain(self, grace_s: float = 20.0) -> list[str]:
        """The shutdown hook: cancel every running job, wait up to ``grace_s`` for them to stop, and requeue
        those that did not (a body that ignores the cancel), so none is left RUNNING without an owner."""
        if self.sweeper is not None:
            self.sweeper.stop()
        interrupted = self.interrupt_all()
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.1)
        with self._lock:
            left = dict(self._attempts)
        for job_id, attempt in left.items():
            try:
                current = self.jobs.get(job_id)
            except AlloyError:
                continue
            if current.attempts == attempt:  # still this runner's: one interruption, one attempt
                requeue_lost(self.jobs, current, f"replica shut down during the {self.kind.value} job")
        return interrupted

    def start_sweeper(
        self,
        *,
        stale_after_s: float,
        dispatch: Callable[[str], None],
        interval_s: float = DEFAULT_SWEEP_S,
        first_after_s: float = 1.0,
    ) -> OrphanSweeper:
        """Requeue this kind's jobs whose owner went silent (removing what their lost runs left) and ``dispatch``
        them again, periodically; the jobs accepted here are never taken for lost."""
        self.sweeper = OrphanSweeper(
            self.jobs,
            self.kind,
            stale_after_s=stale_after_s,
            running_here=self._held,
            dispatch=dispatch,
            interval_s=interval_s,
            first_after_s=first_after_s,
            clean=self.clean_lost_run,
        ).start()
        return self.sweeper

    def _held(self) -> set[str]:
        with self._lock:
            return set(self.accepted)


def _run_all(actions: Sequence[Callable[[], object]], what: str, job_id: str) -> None:
    for action in reversed(actions):
        try:
            action()
        except Exception:
            logger.exception("%s action of job %s failed", what, job_id)


async def run_shielded(work: Callable[[], T], *, label: str = "job") -> T:
    """Run blocking ``work`` in a worker thread as this coroutine. If the caller goes away (an ingress replica
    restarted, a client disconnected) the work is not cancelled: this coroutine keeps awaiting it, so the job
    stays an ongoing request of its replica (visible to autoscaling, drained by a graceful shutdown)."""
    task = asyncio.ensure_future(asyncio.to_thread(work))
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            logger.info("caller of %s went away; it continues", label)
