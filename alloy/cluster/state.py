"""The cluster lifecycle state: one persisted row (``cluster_state``, id 1) that every process reads.

States and the moves between them::

    STOPPED --begin_start--> STARTING --mark_ready--> READY --graceful--> DRAINING --> STOPPING --> STOPPED
                               |                        |                                 ^
                               +--start failed----------+--forced-------------------------+--> STOPPED

``begin_start`` is allowed from every state: a start that finds READY, DRAINING, STOPPING or STARTING means the
previous cluster died without finishing its shutdown (kill -9, node loss), which the start records as an
unclean previous stop so recovery runs. Every other move is a compare-and-set on the state column, so two
processes racing (an operator's ``alloy stop`` and a SIGTERM handler) cannot both win.

The ``snapshot`` JSON column holds, by key:
- ``pools``: replica counts per deployment, restored by a warm start;
- ``last_start`` / ``last_stop``: the step log (name, status, duration) of the latest start and stop;
- ``recovery``: the latest consistency report's summary (incl. model records marked broken);
- keys other modules own (e.g. ``draining_nodes``), which this store never drops.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from alloy.errors import AlloyError, ErrorCode
from alloy.storage.db import Database
from alloy.storage.db.models import ClusterStateRow
from alloy.storage.db.page import rows_changed
from alloy.storage.db.types import utcnow

ROW_ID = 1
CAS_RETRIES = 5


class ClusterState(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"  # graceful shutdown: submissions refused, waiting for active merges/evaluations
    STOPPING = "STOPPING"  # flushing, closing, terminating (graceful step 3+, or forced)
    STOPPED = "STOPPED"

    @property
    def accepts_requests(self) -> bool:
        """Reads and status are served while READY or shutting down; nothing is served while STARTING."""
        return self in (ClusterState.READY, ClusterState.DRAINING, ClusterState.STOPPING)

    @property
    def accepts_submissions(self) -> bool:
        return self is ClusterState.READY


# Moves other than begin_start (which is legal from every state, see the module docstring).
LEGAL_MOVES: dict[ClusterState, frozenset[ClusterState]] = {
    ClusterState.STOPPED: frozenset(),
    ClusterState.STARTING: frozenset({ClusterState.READY, ClusterState.STOPPING, ClusterState.STOPPED}),
    ClusterState.READY: frozenset({ClusterState.DRAINING, ClusterState.STOPPING}),
    ClusterState.DRAINING: frozenset({ClusterState.STOPPING}),
    ClusterState.STOPPING: frozenset({ClusterState.STOPPED}),
}
CLEAN_END_STATES = frozenset({ClusterState.STOPPED})


class StepLogEntry(BaseModel):
    name: str
    status: str  # ok | failed | skipped
    duration_s: float
    detail: str | None = None


class LifecycleRun(BaseModel):
    """One start or stop as persisted: its mode, the step log and how it ended."""

    mode: str  # cold | warm | graceful | forced | graceful->forced
    ok: bool
    steps: list[StepLogEntry] = Field(default_factory=list)
    total_s: float = 0.0
    error: str | None = None
    finished_at: datetime | None = None


class ClusterStatus(BaseModel):
    state: ClusterState
    config_version: int
    pools: dict[str, int]
    last_start: LifecycleRun | None
    last_stop: LifecycleRun | None
    recovery: dict[str, Any] | None
    updated_at: datetime | None
    snapshot: dict[str, Any]

    @property
    def previous_stop_was_clean(self) -> bool:
        return self.state in CLEAN_END_STATES and (self.last_stop is None or self.last_stop.ok)


def not_ready_error(state: ClusterState | str, *, submission: bool = False) -> AlloyError:
    """The 503 a request gets while the cluster cannot serve it: before READY, or a job submission while
    shutting down. The ``cluster_state`` detail lets clients tell "retry soon" from "going away"."""
    state = ClusterState(state)
    if state is ClusterState.STARTING:
        message = "the cluster is starting and not READY yet; retry shortly"
    elif state in (ClusterState.DRAINING, ClusterState.STOPPING):
        message = (
            f"the cluster is shutting down ({state.value}); new {'jobs are' if submission else 'requests are'} refused"
        )
    else:
        message = f"the cluster is {state.value}; it serves requests only when READY"
    return AlloyError(
        ErrorCode.SERVICE_UNAVAILABLE,
        message,
        {"cluster_state": state.value, "retryable": state is ClusterState.STARTING},
    )


def state_metric_values(state: ClusterState | str) -> dict[str, int]:
    """One-hot values for a ``alloy_cluster_state{state=...}`` gauge: every state, 1 for the current one."""
    state = ClusterState(state)
    return {s.value: int(s is state) for s in ClusterState}


class ClusterStateStore:
    def __init__(self, db: Database):
        self.db = db

    # -- reads ----------------------------------------------------------------------------------------------
    def get(self) -> ClusterStatus:
        with self.db.session() as session:
            row = session.get(ClusterStateRow, ROW_ID, populate_existing=True)
            if row is None:
                return _status(ClusterState.STOPPED.value, 1, {}, None)
            return _status(row.state, row.config_version, dict(row.snapshot or {}), row.updated_at)

    def state(self) -> ClusterState:
        return self.get().state

    def pool_snapshot(self) -> dict[str, int]:
        return self.get().pools

    def require(self, *, submission: bool = False) -> ClusterStatus:
        """The current status, or the 503 this request must get (see :func:`not_ready_error`)."""
        status = self.get()
        allowed = status.state.accepts_submissions if submission else status.state.accepts_requests
        if not allowed:
            raise not_ready_error(status.state, submission=submission)
        return status

    def submission_guard(self, session: Session) -> None:
        """A job-creation guard (``JobStore.create(guards=...)``): refuse with 503 unless the cluster is READY,
        holding the state row until the job's transaction ends. The touch is a write (``SET state = state`` on
        a READY row), so a concurrent move to DRAINING or STOPPING waits for the job to commit (and the
        graceful stop then waits for the job), or the job sees the new state and is refused: nothing is
        accepted after DRAINING begins."""
        touched = rows_changed(
            session,
            update(ClusterStateRow)
            .where(ClusterStateRow.id == ROW_ID, ClusterStateRow.state == ClusterState.READY.value)
            .values(state=ClusterStateRow.state)
            .execution_options(synchronize_session=False),
        )
        if touched != 1:
            current = session.scalar(select(ClusterStateRow.state).where(ClusterStateRow.id == ROW_ID))
            raise not_ready_error(current or ClusterState.STOPPED.value, submission=True)

    # -- moves ----------------------------------------------------------------------------------------------
    def begin_start(self, mode: str) -> ClusterStatus:
        """Enter STARTING from any state and return the status *before* it (whose state and last stop tell
        whether the previous run ended cleanly)."""
        previous = self.get()
        self._ensure_row()
        with self.db.session() as session:
            row = _the_row(session)
            snapshot = dict(row.snapshot or {})
            snapshot["last_start"] = LifecycleRun(mode=mode, ok=False).model_dump(mode="json")
            snapshot["previous_state"] = row.state
            row.state, row.snapshot, row.updated_at = ClusterState.STARTING.value, snapshot, utcnow()
        return previous

    def transition(self, target: ClusterState | str, *, expected: ClusterState | str | None = None) -> ClusterStatus:
        """A legal move (LEGAL_MOVES) as a compare-and-set; an illegal one, or losing a race, is CONFLICT.
        Moving to the state the cluster is already in is a no-op (two stop requests are not an error)."""
        target = ClusterState(target)
        self._ensure_row()
        for _ in range(CAS_RETRIES):
            current = self.state()
            if expected is not None and current is not ClusterState(expected):
                raise _conflict(current, target, f"expected {ClusterState(expected).value}")
            if current is target:
                return self.get()
            if target not in LEGAL_MOVES[current]:
                raise _conflict(current, target, "illegal move")
            with self.db.session() as session:
                changed = rows_changed(
                    session,
                    update(ClusterStateRow)
                    .where(ClusterStateRow.id == ROW_ID, ClusterStateRow.state == current.value)
                    .values(state=target.value, updated_at=utcnow())
                    .execution_options(synchronize_session=False),
                )
            if changed == 1:
                return self.get()
        raise _conflict(self.state(), target, "state kept changing during")

    def mark_ready(self, *, config_version: int | None = None) -> ClusterStatus:
        status = self.transition(ClusterState.READY, expected=ClusterState.STARTING)
        if config_version is not None:
            status = self.set_config_version(config_version)
        return status

    # -- snapshot fields ------------------------------------------------------------------------------------
    def set_config_version(self, version: int) -> ClusterStatus:
        self._ensure_row()
        with self.db.session() as session:
            row = _the_row(session)
            row.config_version = int(version)
            row.updated_at = utcnow()
        return self.get()

    def save_pool_snapshot(self, pools: dict[str, int]) -> ClusterStatus:
        """Persist the replica count of each deployment (what a warm start restores)."""
        clean = {str(name): int(count) for name, count in pools.items()}
        if any(count < 0 for count in clean.values()):
            raise AlloyError(ErrorCode.VALIDATION_FAILED, "replica counts must be >= 0", {"pools": clean})
        return self.update_snapshot(pools=clean)

    def record_run(self, kind: str, run: LifecycleRun) -> ClusterStatus:
        """Persist the step log of the latest start (``kind="start"``) or stop (``kind="stop"``)."""
        if kind not in ("start", "stop"):
            raise ValueError(f"kind must be start or stop, not {kind!r}")
        return self.update_snapshot(**{f"last_{kind}": run.model_dump(mode="json")})

    def update_snapshot(self, **keys: Any) -> ClusterStatus:
        """Set top-level snapshot keys, keeping every other key (other modules keep theirs there too)."""
        self._ensure_row()
        with self.db.session() as session:
            row = _the_row(session)
            row.snapshot = {**(row.snapshot or {}), **keys}
            row.updated_at = utcnow()
        return self.get()

    def _ensure_row(self) -> None:
        with self.db.session() as session:
            if session.get(ClusterStateRow, ROW_ID) is not None:
                return
        try:
            with self.db.session() as session:
                session.add(
                    ClusterStateRow(
                        id=ROW_ID, state=ClusterState.STOPPED.value, config_version=1, snapshot={}, updated_at=utcnow()
                    )
                )
        except IntegrityError:
            pass  # another process created it first


class CachedClusterState:
    """The state as a hot path (the ingress, per request) needs it: read at most every ``ttl_s`` seconds, so
    the 503 gate costs one query per second, not one per request. Thread-safe."""

    def __init__(self, store: ClusterStateStore, ttl_s: float = 1.0):
        self.store, self.ttl_s = store, ttl_s
        self._value: ClusterState | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def get(self) -> ClusterState:
        now = time.monotonic()
        with self._lock:
            if self._value is None or now - self._read_at >= self.ttl_s:
                self._value, self._read_at = self.store.state(), now
            return self._value

    def submission_guard(self, session: Session) -> None:
        """The authoritative, uncached check of a job submission (see ClusterStateStore.submission_guard)."""
        self.store.submission_guard(session)

    def require(self, *, submission: bool = False) -> ClusterState:
        state = self.get()
        if not (state.accepts_submissions if submission else state.accepts_requests):
            raise not_ready_error(state, submission=submission)
        return state


def _status(state: str, config_version: int, snapshot: dict[str, Any], updated_at) -> ClusterStatus:
    def run(key: str) -> LifecycleRun | None:
        raw = snapshot.get(key)
        return LifecycleRun.model_validate(raw) if raw else None

    return ClusterStatus(
        state=ClusterState(state),
        config_version=config_version,
        pools={str(k): int(v) for k, v in (snapshot.get("pools") or {}).items()},
        last_start=run("last_start"),
        last_stop=run("last_stop"),
        recovery=snapshot.get("recovery"),
        updated_at=updated_at,
        snapshot=snapshot,
    )


def _conflict(current: ClusterState, target: ClusterState, why: str) -> AlloyError:
    return AlloyError(
        ErrorCode.CONFLICT,
        f"cluster state: {why} {current.value} -> {target.value}",
        {"cluster_state": current.value, "requested": target.value},
    )


def _the_row(session: Session) -> ClusterStateRow:
    """The one state row, read afresh and locked until the session ends (every caller writes what it read back;
    ``_ensure_row`` wrote the row before)."""
    row = session.get(ClusterStateRow, ROW_ID, populate_existing=True, with_for_update=True)
    if row is None:
        raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, "the cluster state row is missing", {"component": "database"})
    return row
