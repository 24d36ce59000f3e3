"""Following one job as a stream of events, without Ray or HTTP: what ``GET /jobs/{id}/events`` sends as
Server-Sent Events.

The JobStore keeps two things per job: its history (``job_events`` rows, one per state change, with increasing
ids) and its current ``progress`` (a dict overwritten in place by the runner, throttled). A follower polls both
and yields:

- ``state`` events, one per history row, in order, with the row id as event id: every state a job went through
  is seen even when it passed through several between two polls;
- ``progress`` events whenever the progress snapshot changed (tensors and bytes for merges; generation, best and
  median fitness for evolutions), with id ``<last history id>.<n>``: progress is a snapshot, not a log, so a
  resumed stream gets the latest one, never the ones it missed;
- one ``end`` event carrying the final job once the terminal state has been sent, then the stream stops.

Resuming (``Last-Event-ID``) skips every history row up to the id's integer part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from alloy.jobs.records import JobEvent, JobRecord
from alloy.jobs.store import JobStore

# Progress keys that change without anything happening to the job (the liveness heartbeat, internal flags).
QUIET_PROGRESS_KEYS = frozenset({"heartbeat_at", "cancel_requested"})


@dataclass(frozen=True)
class StreamEvent:
    event: str  # state | progress | end
    id: str
    data: dict[str, Any]


def parse_last_event_id(value: str | None) -> int:
    """The history id a client has seen up to (``"12"`` or ``"12.3"`` -> 12); anything unparsable -> 0 (the
    whole history again: a client with a garbled cursor gets duplicates, never a gap)."""
    if not value:
        return 0
    head = value.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def visible_progress(progress: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (progress or {}).items() if k not in QUIET_PROGRESS_KEYS}


def state_data(event: JobEvent) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude={"id"})


@dataclass
class JobFollower:
    """One stream's cursor over one job; :meth:`poll` returns what happened since the last call."""

    jobs: JobStore
    job_id: str
    after: int = 0
    _progress: dict[str, Any] | None = None
    _progress_seq: int = 0
    finished: bool = False
    # What the end event carries; the HTTP route sends the public job view (GET /jobs/{id}), not the record.
    end_view: Callable[[JobRecord], dict[str, Any]] = lambda job: job.model_dump(mode="json")

    def poll(self) -> list[StreamEvent]:
        if self.finished:
            return []
        # The job first, then its history: a terminal state in the row is then always in the history read
        # after it (both are written in one transaction), so the stream never ends before its last state.
        job = self.jobs.get(self.job_id)
        out = [
            StreamEvent("state", str(e.id), state_data(e)) for e in self.jobs.events(self.job_id) if e.id > self.after
        ]
        if out:
            self.after = int(out[-1].id)
        if job.state.terminal:
            self.finished = True
            out.append(StreamEvent("end", str(self.after), self.end_view(job)))
            return out
        progress = visible_progress(job.progress)
        if progress and progress != self._progress:
            self._progress = progress
            self._progress_seq += 1
            out.append(
                StreamEvent(
                    "progress",
                    f"{self.after}.{self._progress_seq}",
                    {"job_id": job.id, "state": job.state.value, **progress},
                )
            )
        return out


def follow(jobs: JobStore, job_id: str, last_event_id: str | None = None, **options: Any) -> JobFollower:
    """A follower of ``job_id`` resuming after ``last_event_id``; an unknown job raises NOT_FOUND now."""
    jobs.get(job_id)
    return JobFollower(jobs, job_id, after=parse_last_event_id(last_event_id), **options)
