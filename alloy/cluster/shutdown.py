"""Graceful and forced shutdown as ordered, timed steps over injected bodies.

Graceful (``alloy stop``, SIGTERM), as the specification orders it:
1. reject new experiment submissions (state DRAINING: the ingress refuses job creation with 503);
2. wait for active merges and evaluations (``JobStore.active``) up to ``timeout_s`` (default 300 s);
   past the timeout the shutdown escalates to the forced one;
3. flush the ExperimentTracker buffers; 4. close registry connections; 5. terminate the worker pools;
6. mark the cluster STOPPED (persisted, with the step log).

Forced (``alloy stop --force``, or the graceful wait timed out): cancel every active task, flush on a
best-effort basis (a failure is logged, never raised), terminate, mark STOPPED with ``ok=False`` so the next
start runs the consistency check and replays what was interrupted.

Evolutions are not waited for (the specification waits for merges and evaluations only): terminating the
pools interrupts them and the next start resumes them from their last Tune checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from alloy.cluster.startup import Step, run_timed
from alloy.cluster.state import ClusterState, ClusterStateStore, LifecycleRun, StepLogEntry
from alloy.jobs.records import JobKind
from alloy.jobs.store import JobStore
from alloy.storage.db.types import utcnow

logger = logging.getLogger("alloy.lifecycle")

WAITED_KINDS = (JobKind.MERGE, JobKind.EVALUATION)
DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.5

Action = Callable[[], "str | None"]


def _noop() -> str:
    return "nothing to do"


@dataclass
class ShutdownActions:
    """What the caller provides: each a no-argument callable returning an optional detail for the log.

    ``cancel_active`` interrupts the running tasks (the engines requeue their jobs with an ``interrupted``
    event); ``flush_tracker`` flushes the ExperimentTracker; ``close_registries`` closes registry and database
    connections; ``terminate_pools`` stops the worker pools (Serve deployments, then the Ray processes)."""

    cancel_active: Action = _noop
    flush_tracker: Action = _noop
    close_registries: Action = _noop
    terminate_pools: Action = _noop


class ShutdownReport(BaseModel):
    run: LifecycleRun
    escalated: bool = False
    waited_for: list[str] = Field(default_factory=list)  # merges/evaluations active when the wait began
    unfinished: list[str] = Field(default_factory=list)  # still active when the wait ended


class Shutdown:
    """Runs a graceful (``graceful()``) or forced (``forced()``) shutdown over the given actions."""

    def __init__(
        self,
        state: ClusterStateStore,
        jobs: JobStore,
        actions: ShutdownActions,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = POLL_S,
        force_requested: Callable[[], bool] | None = None,
    ):
        """``force_requested``: asked while the graceful wait polls; True ends the wait at once and escalates
        (an operator's ``alloy stop --force`` or a second Ctrl-C during a graceful stop)."""
        self.state, self.jobs, self.actions = state, jobs, actions
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.force_requested = force_requested or (lambda: False)

    # -- graceful -------------------------------------------------------------------------------------------
    def graceful(self) -> ShutdownReport:
        started = time.perf_counter()
        log: list[StepLogEntry] = []
        outcome: dict[str, list[str]] = {"waited_for": [], "unfinished": []}

        def reject(_ctx: Any) -> str:
            current = self.state.state()
            if current in (ClusterState.STARTING, ClusterState.READY):
                self.state.transition(
                    ClusterState.STOPPING if current is ClusterState.STARTING else ClusterState.DRAINING
                )
            return f"{current.value} -> {self.state.state().value}: new submissions get 503"

        def wait(_ctx: Any) -> str:
            outcome["waited_for"] = self._active_ids()
            outcome["unfinished"] = self._wait_for_active()
            if outcome["unfinished"] and self.force_requested():
                return f"force requested: {len(outcome['unfinished'])} still active"
            if outcome["unfinished"]:
                return f"timeout after {self.timeout_s:g}s: {len(outcome['unfinished'])} still active"
            return f"{len(outcome['waited_for'])} active merges/evaluations finished"

        for number, step in enumerate(
            [Step("reject submissions", reject), Step("wait for active merges and evaluations", wait)], start=1
        ):
            entry, error = run_timed(step, None, label=f"graceful stop step {number}/6")
            log.append(entry)
            if error is not None or (step.name.startswith("wait") and outcome["unfinished"]):
                if error is not None:
                    why = f"graceful shutdown step {step.name!r} failed: {entry.detail}"
                elif self.force_requested():
                    why = "forced by the operator during the graceful wait"
                else:
                    why = f"graceful shutdown exceeded its {self.timeout_s:g}s timeout"
                logger.warning("%s: forcing", why)
                report = self._forced(log, started, mode="graceful->forced", why=why)
                report.escalated = True
                report.waited_for, report.unfinished = outcome["waited_for"], outcome["unfinished"]
                return report

        self._to_stopping()
        steps = [
            Step("flush tracker", lambda _c: self.actions.flush_tracker()),
            Step("close registries", lambda _c: self.actions.close_registries()),
            Step("terminate worker pools", lambda _c: self.actions.terminate_pools()),
        ]
        ok, errors = True, []
        for number, step in enumerate(steps, start=3):
            entry, error = run_timed(step, None, label=f"graceful stop step {number}/6")
            log.append(entry)
            if error is not None:  # keep going: a stop that stops half-way leaves more behind than one that logs
                ok = False
                errors.append(f"{step.name}: {entry.detail}")
        run = self._mark_stopped(
            log, started, mode="graceful", ok=ok, error="; ".join(errors) or None, label="graceful stop step 6/6"
        )
        return ShutdownReport(run=run, waited_for=outcome["waited_for"])

    # -- forced ---------------------------------------------------------------------------------------------
    def forced(self, why: str = "forced by the operator") -> ShutdownReport:
        return self._forced([], time.perf_counter(), mode="forced", why=why)

    def _forced(self, log: list[StepLogEntry], started: float, *, mode: str, why: str) -> ShutdownReport:
        self._to_stopping()
        steps = [
            Step("cancel active tasks", lambda _c: self.actions.cancel_active()),
            Step("flush tracker (best effort)", lambda _c: self.actions.flush_tracker()),
            Step("close registries (best effort)", lambda _c: self.actions.close_registries()),
            Step("terminate processes", lambda _c: self.actions.terminate_pools()),
        ]
        for number, step in enumerate(steps, start=1):
            log.append(run_timed(step, None, label=f"forced stop step {number}/{len(steps) + 1}")[0])
        run = self._mark_stopped(
            log, started, mode=mode, ok=False, error=why, label=f"forced stop step {len(steps) + 1}/{len(steps) + 1}"
        )
        return ShutdownReport(run=run, unfinished=self._active_ids())

    # -- helpers --------------------------------------------------------------------------------------------
    def _active_ids(self) -> list[str]:
        return [job.id for kind in WAITED_KINDS for job in self.jobs.active(kind=kind)]

    def _wait_for_active(self) -> list[str]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            active = self._active_ids()
            if not active or time.monotonic() >= deadline or self.force_requested():
                return active
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    def _to_stopping(self) -> None:
        current = self.state.state()
        if current in (ClusterState.READY, ClusterState.DRAINING, ClusterState.STARTING):
            self.state.transition(ClusterState.STOPPING)

    def _mark_stopped(
        self, log: list[StepLogEntry], started: float, *, mode: str, ok: bool, error: str | None, label: str
    ) -> LifecycleRun:
        def mark(_ctx: Any) -> str:
            if self.state.state() is not ClusterState.STOPPED:
                self.state.transition(ClusterState.STOPPED)
            return ClusterState.STOPPED.value

        entry, failure = run_timed(Step("mark STOPPED", mark), None, label=label)
        log.append(entry)
        run = LifecycleRun(
            mode=mode,
            ok=ok and failure is None,
            steps=log,
            total_s=round(time.perf_counter() - started, 4),
            error=error or (entry.detail if failure else None),
            finished_at=utcnow(),
        )
        try:
            self.state.record_run("stop", run)
        except Exception:
            logger.warning("could not persist the stop record", exc_info=True)
        logger.info("%s stop: STOPPED in %.3fs (ok=%s)", mode, run.total_s, run.ok)
        return run
