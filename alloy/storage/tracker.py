"""The experiment tracker: experiments, their metric results and evolution trials.

Results and trials are buffered in memory and written by ``flush()`` in one transaction, which also appends a
row to ``tracker_log``; that row's id is the log sequence number (LSN), so it advances on every flush that wrote
something, across every process sharing the database. Reads return flushed rows plus the local buffer.
Experiments themselves are written at once: results and trials refer to them.
"""

from __future__ import annotations

import threading
import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel
from sqlalchemy import func, select

from alloy.errors import not_found, validation_failed
from alloy.storage.db import Database, Page
from alloy.storage.db.models import ExperimentRecordRow, ExperimentRow, TrackerLogRow, TrialRow
from alloy.storage.db.page import check_paging, count_rows
from alloy.storage.db.types import utcnow


class Experiment(BaseModel):
    id: str
    name: str
    kind: str
    params: dict[str, Any]
    owner: str | None
    created_at: datetime


class MetricResult(BaseModel):
    experiment_id: str
    model_id: str
    dataset_id: str | None
    split: str | None
    metric: str
    value: float
    duration_s: float | None
    created_at: datetime
    lsn: int | None = None  # None while buffered


class Trial(BaseModel):
    experiment_id: str
    trial_id: str
    generation: int
    genome: dict[str, Any]
    recipe: dict[str, Any]
    metrics: dict[str, Any]
    parent_trial: str | None
    created_at: datetime
    lsn: int | None = None  # None while buffered


class ExperimentTracker:
    def __init__(self, db: Database):
        self.db = db
        self._lock = threading.Lock()  # guards the buffers
        self._flush_lock = threading.Lock()  # one flush at a time per process
        self._results: list[MetricResult] = []
        self._trials: dict[tuple[str, str], Trial] = {}  # a re-recorded trial replaces the buffered one
        self._known: set[str] = set()

    # -- experiments (written at once) ----------------------------------------------------------------------
    def create_experiment(
        self,
        name: str,
        kind: str,
        params: dict[str, Any] | None = None,
        owner: str | None = None,
        experiment_id: str | None = None,
    ) -> str:
        experiment_id = experiment_id or uuid.uuid4().hex
        if not name:
            raise validation_failed("an experiment needs a name")
        with self.db.session() as session:
            session.add(
                ExperimentRow(
                    id=experiment_id, name=name, kind=kind, params=params or {}, owner=owner, created_at=utcnow()
                )
            )
        self._known.add(experiment_id)
        return experiment_id

    def get_experiment(self, experiment_id: str) -> Experiment:
        with self.db.session() as session:
            row = session.get(ExperimentRow, experiment_id)
            if row is None:
                raise not_found("experiment", experiment_id)
            return Experiment.model_validate(row, from_attributes=True)

    def list_experiments(
        self, offset: int = 0, limit: int = 50, *, kind: str | None = None, owner: str | None = None
    ) -> Page[Experiment]:
        check_paging(offset, limit)
        query = select(ExperimentRow)
        if kind is not None:
            query = query.where(ExperimentRow.kind == kind)
        if owner is not None:
            query = query.where(ExperimentRow.owner == owner)
        with self.db.session() as session:
            total = count_rows(session, query)
            rows = session.scalars(
                query.order_by(ExperimentRow.created_at.desc(), ExperimentRow.id).offset(offset).limit(limit)
            ).all()
            return Page[Experiment](
                items=[Experiment.model_validate(r, from_attributes=True) for r in rows],
                total=total,
                offset=offset,
                limit=limit,
            )

    def _require(self, experiment_id: str) -> None:
        if experiment_id not in self._known:
            self.get_experiment(experiment_id)
            self._known.add(experiment_id)

    # -- buffered writes ------------------------------------------------------------------------------------
    def log_result(
        self,
        experiment_id: str,
        model_id: str,
        dataset_id: str | None,
        split: str | None,
        metric: str,
        value: float,
        duration_s: float | None = None,
    ) -> None:
        self._require(experiment_id)
        result = MetricResult(
            experiment_id=experiment_id,
            model_id=model_id,
            dataset_id=dataset_id,
            split=split,
            metric=metric,
            value=value,
            duration_s=duration_s,
            created_at=utcnow(),
        )
        with self._lock:
            self._results.append(result)

    def record_trial(
        self,
        experiment_id: str,
        trial_id: str,
        generation: int,
        genome: dict[str, Any],
        recipe: dict[str, Any],
        metrics: dict[str, Any],
        parent_trial: str | None = None,
    ) -> None:
        self._require(experiment_id)
        trial = Trial(
            experiment_id=experiment_id,
            trial_id=trial_id,
            generation=generation,
            genome=genome,
            recipe=recipe,
            metrics=metrics,
            parent_trial=parent_trial,
            created_at=utcnow(),
        )
        with self._lock:
            self._trials[(experiment_id, trial_id)] = trial

    def pending(self) -> int:
        with self._lock:
            return len(self._results) + len(self._trials)

    def last_lsn(self) -> int:
        with self.db.session() as session:
            return session.scalar(select(func.max(TrackerLogRow.lsn))) or 0

    def flush(self) -> int:
        """Write the buffers in one transaction; return the log sequence number (unchanged when nothing was
        pending). On failure the buffers are kept for the next attempt."""
        with self._flush_lock:
            with self._lock:
                results, trials = self._results, self._trials
                self._results, self._trials = [], {}
            if not results and not trials:
                return self.last_lsn()
            try:
                return self._write(results, list(trials.values()))
            except BaseException:
                with self._lock:
                    self._results = results + self._results
                    self._trials = {**trials, **self._trials}
                raise

    def _write(self, results: list[MetricResult], trials: list[Trial]) -> int:
        with self.db.session() as session:
            log = TrackerLogRow(records=len(results), trials=len(trials), flushed_at=utcnow())
            session.add(log)
            session.flush()
            session.add_all(ExperimentRecordRow(**r.model_dump(exclude={"lsn"}), lsn=log.lsn) for r in results)
            for trial in trials:
                session.merge(TrialRow(**trial.model_dump(exclude={"lsn"}), lsn=log.lsn))
            return log.lsn

    # -- reads (flushed + buffered) -------------------------------------------------------------------------
    def results(self, experiment_id: str) -> list[MetricResult]:
        self._require(experiment_id)
        with self.db.session() as session:
            rows = session.scalars(
                select(ExperimentRecordRow)
                .where(ExperimentRecordRow.experiment_id == experiment_id)
                .order_by(ExperimentRecordRow.id)
            ).all()
            flushed = [MetricResult.model_validate(r, from_attributes=True) for r in rows]
        with self._lock:
            return flushed + [r for r in self._results if r.experiment_id == experiment_id]

    def trials(self, experiment_id: str, generation: int | None = None) -> list[Trial]:
        self._require(experiment_id)
        query = select(TrialRow).where(TrialRow.experiment_id == experiment_id)
        if generation is not None:
            query = query.where(TrialRow.generation == generation)
        with self.db.session() as session:
            rows = session.scalars(query).all()
            merged = {r.trial_id: Trial.model_validate(r, from_attributes=True) for r in rows}
        with self._lock:
            for (exp, trial_id), trial in self._trials.items():
                if exp == experiment_id and (generation is None or trial.generation == generation):
                    merged[trial_id] = trial
        return sorted(merged.values(), key=lambda t: (t.generation, t.created_at, t.trial_id))
