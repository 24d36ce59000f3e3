"""The job store: merge, evaluation and evolution jobs, their state machine and their history.

Every state change is a compare-and-set (``UPDATE ... WHERE id = :id AND state = :seen``), so when two processes
race to move the same job exactly one wins and the other gets CONFLICT. ``requeue`` puts an interrupted job back
to CREATED for replay after a crash; the history (``events``) keeps what happened.
"""

from __future__ import annotations

import builtins  # the store's own list() method shadows the name in annotations below it
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from alloy.errors import AlloyError, ErrorCode, not_found, public_message, validation_failed
from alloy.jobs.records import (
    JOB_ID_PATTERN,
    LEGAL_MOVES,
    NON_TERMINAL_STATES,
    JobError,
    JobEvent,
    JobKind,
    JobRecord,
    JobState,
)
from alloy.storage.db import Database, Page
from alloy.storage.db.models import JobEventRow, JobRow
from alloy.storage.db.page import check_paging, count_rows, rows_changed
from alloy.storage.db.types import utcnow

TRANSITION_FIELDS = frozenset({"progress", "result", "error"})
CAS_RETRIES = 20  # a lost compare-and-set reads again, after a short random pause (_cas_pause)
logger = logging.getLogger("alloy.jobs")

# A check run inside the job-creation transaction (see JobStore.create); it refuses by raising an AlloyError.
Guard = Callable[[Session], None]


def _record(row: JobRow) -> JobRecord:
    return JobRecord(
        id=row.id,
        kind=JobKind(row.kind),
        state=JobState(row.state),
        progress=row.progress or {},
        request=row.request or {},
        result=row.result,
        error=JobError.model_validate(row.error) if row.error else None,
        owner=row.owner,
        attempts=row.attempts,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def _public_error(job_id: str, error: JobError) -> dict[str, Any]:
    """The error as recorded (and shown by GET /jobs/{id} and its events): an INTERNAL_ERROR's own text goes to
    the log under the job id, the record keeps the generic message (alloy.errors.public_message)."""
    shown = public_message(error.code, error.message, job_id)
    if shown != error.message:
        logger.error("job %s failed with INTERNAL_ERROR: %s", job_id, error.message)
    return JobError(code=error.code, message=shown).model_dump()


def output_claimed(model_id: str | None) -> AlloyError:
    """The answer when another active job already claims ``model_id`` as its output."""
    return AlloyError(
        ErrorCode.ALREADY_EXISTS,
        f"model {model_id!r} is already being produced by another job",
        {"field": "output_model_id", "model_id": model_id},
    )


def _unchanged_since_read(row: JobRow):
    """The compare-and-set condition of a write that read ``row``: the job is as it was read. Every write sets
    ``updated_at``, so it is the row's version: a progress merge or a move that read an older row (a heartbeat
    racing a candidate's progress) matches nothing and reads again, instead of writing back the stale progress it
    read and losing the other's keys. Writers read the row locked (``_row(lock=True)``: FOR UPDATE on PostgreSQL,
    every SQLite transaction begins IMMEDIATE), so they queue instead of losing tries; this check is what keeps
    a key safe should a write ever read unlocked."""
    return (
        (JobRow.id == row.id)
        & (JobRow.state == row.state)
        & (JobRow.attempts == row.attempts)
        & (JobRow.updated_at == row.updated_at)
    )


def _cas_pause(try_: int) -> None:
    """A jittered pause after the ``try_``-th lost compare-and-set (writers that collided once would collide
    again in lockstep): up to 1 ms, growing by 1 ms a try."""
    time.sleep(random.uniform(0.0, 0.001 * (try_ + 1)))


def _conflict(job_id: str, current: str, target: str, why: str = "illegal move") -> AlloyError:
    return AlloyError(
        ErrorCode.CONFLICT,
        f"job {job_id!r}: {why} {current} -> {target}",
        {"job_id": job_id, "state": current, "requested": target},
    )


class JobStore:
    def __init__(self, db: Database):
        self.db = db

    # -- writes ---------------------------------------------------------------------------------------------
    def create(
        self,
        kind: JobKind | str,
        request: dict[str, Any],
        owner: str | None = None,
        job_id: str | None = None,
        *,
        output_model_id: str | None = None,
        guards: Iterable[Guard] = (),
    ) -> JobRecord:
        """Write a CREATED job. ``output_model_id`` claims that id for the job while it is active (another
        active job holding it -> ALREADY_EXISTS). Then each guard runs inside the same transaction and may
        refuse the job by raising (nothing is written then). They run after the row, so that what they read is
        ordered against the claim: on SQLite the insert holds the write lock, on PostgreSQL a concurrent claim
        of the same id waits for this one, and a guard that locks a row (the cluster-state gate) keeps it
        locked until the job is committed."""
        try:
            kind = JobKind(kind)
        except ValueError:
            raise validation_failed(f"unknown job kind {kind!r}", allowed=[k.value for k in JobKind]) from None
        job_id = job_id or uuid.uuid4().hex
        if not JOB_ID_PATTERN.fullmatch(job_id):
            raise validation_failed("invalid job id", job_id=job_id)
        now = utcnow()
        row = JobRow(
            id=job_id,
            kind=kind.value,
            state=JobState.CREATED.value,
            progress={},
            request=request,
            owner=owner,
            attempts=0,
            output_model_id=output_model_id,
            created_at=now,
            updated_at=now,
        )
        with self.db.session() as session:
            if session.get(JobRow, job_id) is not None:
                raise AlloyError(ErrorCode.ALREADY_EXISTS, f"job {job_id!r} already exists", {"job_id": job_id})
            session.add(row)
            try:
                session.flush()
            except IntegrityError:
                raise output_claimed(output_model_id) from None
            for guard in guards:
                guard(session)
            session.add(JobEventRow(job_id=job_id, event="created", to_state=JobState.CREATED.value, at=now))
        return _record(row)

    def transition(self, job_id: str, state: JobState | str, *, attempt: int | None = None, **fields: Any) -> JobRecord:
        """Move a job forward (see LEGAL_MOVES). ``fields``: ``progress`` (merged), ``result``, ``error``.
        ``attempt``: only if the job is still at that attempt (a runner's own moves: CONFLICT once requeued)."""
        target = JobState(state)
        unknown = set(fields) - TRANSITION_FIELDS
        if unknown:
            raise TypeError(f"transition() got unexpected fields {sorted(unknown)}")
        return self._move(job_id, target, lambda current: target in LEGAL_MOVES[current], fields, attempt=attempt)

    def complete(self, job_id: str, result: dict[str, Any], *, attempt: int | None = None) -> JobRecord:
        return self.transition(job_id, JobState.COMPLETED, attempt=attempt, result=result, progress={"percent": 100.0})

    def fail(self, job_id: str, code: ErrorCode | str, message: str, *, attempt: int | None = None) -> JobRecord:
        code = code.value if isinstance(code, ErrorCode) else str(code)
        return self.transition(job_id, JobState.FAILED, attempt=attempt, error={"code": code, "message": message})

    def requeue(self, job_id: str, reason: str, *, attempt: int | None = None) -> JobRecord:
        """Put a non-terminal job back to CREATED so it is replayed (recovery after an interruption).
        ``attempt``: only if the job is still at that attempt (CONFLICT otherwise), so that two who saw the same
        lost run never count its interruption twice."""
        return self._move(
            job_id, JobState.CREATED, lambda current: not current.terminal, {}, reason=reason, attempt=attempt
        )

    def update_progress(self, job_id: str, **progress: Any) -> JobRecord:
        """Merge keys into the job's progress (percent, tensors_done, bytes_done, generation, best, ...)."""
        for try_ in range(CAS_RETRIES):
            with self.db.session() as session:
                row = self._row(session, job_id, lock=True)
                current = JobState(row.state)
                if current.terminal:
                    raise _conflict(job_id, current.value, current.value, "progress after the end:")
                merged = {**(row.progress or {}), **progress}
                changed = rows_changed(
                    session,
                    update(JobRow)
                    .where(_unchanged_since_read(row))
                    .values(progress=merged, updated_at=utcnow())
                    .execution_options(synchronize_session=False),
                )
            if changed == 1:
                return self.get(job_id)
            _cas_pause(try_)
        raise _conflict(job_id, "?", "progress", "kept changing state during")

    def _move(
        self,
        job_id: str,
        target: JobState,
        allowed,
        fields: dict[str, Any],
        reason: str | None = None,
        attempt: int | None = None,
    ) -> JobRecord:
        for try_ in range(CAS_RETRIES):
            if self._try_move(job_id, target, allowed, fields, reason, attempt):
                return self.get(job_id)
            _cas_pause(try_)
        raise _conflict(job_id, "?", target.value, "kept changing during")

    def _try_move(
        self,
        job_id: str,
        target: JobState,
        allowed,
        fields: dict[str, Any],
        reason: str | None,
        attempt: int | None,
    ) -> bool:
        """One compare-and-set try of a move: False when only a progress write (a heartbeat, a candidate) came
        in between the read and the write, so the caller reads again; a conflicting state or attempt raises."""
        with self.db.session() as session:
            row = self._row(session, job_id, lock=True)
            current = JobState(row.state)
            if not allowed(current):
                raise _conflict(job_id, current.value, target.value)
            if attempt is not None and row.attempts != attempt:
                raise _conflict(job_id, current.value, target.value, f"attempt {attempt} is over ({row.attempts}):")
            now = utcnow()
            values: dict[str, Any] = {"state": target.value, "updated_at": now}
            if "progress" in fields:
                values["progress"] = {**(row.progress or {}), **(fields["progress"] or {})}
            if "result" in fields:
                values["result"] = fields["result"]
            if "error" in fields:
                values["error"] = _public_error(job_id, JobError.model_validate(fields["error"]))
            if target is JobState.PREPARING and row.started_at is None:
                values["started_at"] = now
            if target.terminal:
                values["finished_at"] = now
            event = "transition"
            if target is JobState.CREATED:  # requeue: forget the interrupted attempt's progress and error
                values.update(progress={}, error=None, attempts=row.attempts + 1)
                event = "interrupted"
            elif current is JobState.CREATED and row.attempts > 0:
                event = "replayed"
            changed = rows_changed(
                session,
                update(JobRow)
                .where(_unchanged_since_read(row))
                .values(**values)
                .execution_options(synchronize_session=False),
            )
            if changed != 1:
                return False
            session.add(
                JobEventRow(
                    job_id=job_id,
                    event=event,
                    from_state=current.value,
                    to_state=target.value,
                    reason=reason,
                    details=values.get("error"),
                    at=now,
                )
            )
        return True

    # -- reads ----------------------------------------------------------------------------------------------
    @staticmethod
    def _row(session, job_id: str, *, lock: bool = False) -> JobRow:
        """The job's row, read afresh; ``lock``: held until the session ends (a read-modify-write)."""
        row = session.get(JobRow, job_id, populate_existing=True, with_for_update=lock)
        if row is None:
            raise not_found("job", job_id)
        return row

    def get(self, job_id: str) -> JobRecord:
        with self.db.session() as session:
            return _record(self._row(session, job_id))

    def list(
        self,
        state: JobState | str | None = None,
        kind: JobKind | str | None = None,
        owner: str | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> Page[JobRecord]:
        check_paging(offset, limit)
        query = select(JobRow)
        if state is not None:
            query = query.where(JobRow.state == JobState(state).value)
        if kind is not None:
            query = query.where(JobRow.kind == JobKind(kind).value)
        if owner is not None:
            query = query.where(JobRow.owner == owner)
        with self.db.session() as session:
            total = count_rows(session, query)
            rows = session.scalars(
                query.order_by(JobRow.created_at.desc(), JobRow.id).offset(offset).limit(limit)
            ).all()
            return Page[JobRecord](items=[_record(r) for r in rows], total=total, offset=offset, limit=limit)

    def active(self, kind: JobKind | str | None = None) -> builtins.list[JobRecord]:
        """Every non-terminal job, oldest first (what recovery replays and shutdown waits for)."""
        query = select(JobRow).where(JobRow.state.in_([s.value for s in NON_TERMINAL_STATES]))
        if kind is not None:
            query = query.where(JobRow.kind == JobKind(kind).value)
        with self.db.session() as session:
            rows = session.scalars(query.order_by(JobRow.created_at, JobRow.id)).all()
            return [_record(r) for r in rows]

    def claimant(self, output_model_id: str) -> str | None:
        """The active job that claims ``output_model_id`` as its output, if any."""
        with self.db.session() as session:
            return session.scalar(
                select(JobRow.id).where(
                    JobRow.output_model_id == output_model_id,
                    JobRow.state.in_([s.value for s in NON_TERMINAL_STATES]),
                )
            )

    def events(self, job_id: str) -> builtins.list[JobEvent]:
        with self.db.session() as session:
            self._row(session, job_id)
            rows = session.scalars(
                select(JobEventRow).where(JobEventRow.job_id == job_id).order_by(JobEventRow.id)
            ).all()
            return [
                JobEvent(
                    id=r.id,
                    job_id=r.job_id,
                    event=r.event,
                    from_state=JobState(r.from_state) if r.from_state else None,
                    to_state=JobState(r.to_state) if r.to_state else None,
                    reason=r.reason,
                    details=r.details,
                    at=r.at,
                )
                for r in rows
            ]
