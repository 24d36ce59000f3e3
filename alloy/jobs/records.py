"""The records of a job (its kind, its states and their legal moves, the row as read, its history), apart from
the store that writes them: pure pydantic and enums, so the wire models, the HTTP client and a Tune trial actor
can name a job's state without importing SQLAlchemy and alembic (a second of a trial actor's start)."""

from __future__ import annotations

import re
from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel


class JobKind(str, Enum):
    MERGE = "merge"
    EVALUATION = "evaluation"
    EVOLUTION = "evolution"


class JobState(str, Enum):
    CREATED = "CREATED"
    PREPARING = "PREPARING"
    RUNNING = "RUNNING"
    EVALUATING = "EVALUATING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED})
NON_TERMINAL_STATES = frozenset(set(JobState) - TERMINAL_STATES)

# Forward moves; FAILED is reachable from every non-terminal state and CREATED only through requeue().
LEGAL_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.CREATED: frozenset({JobState.PREPARING, JobState.FAILED}),
    JobState.PREPARING: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.EVALUATING, JobState.COMPLETED, JobState.FAILED}),
    JobState.EVALUATING: frozenset({JobState.COMPLETED, JobState.FAILED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
}

JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class JobError(BaseModel):
    code: str
    message: str


class JobRecord(BaseModel):
    id: str
    kind: JobKind
    state: JobState
    progress: dict[str, Any]
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: JobError | None
    owner: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobEvent(BaseModel):
    id: int
    job_id: str
    event: str  # created | transition | interrupted | replayed
    from_state: JobState | None
    to_state: JobState | None
    reason: str | None
    details: dict[str, Any] | None
    at: datetime
