"""Cold and warm start as ordered lists of named, timed steps.

The sequences follow the service specification ("Cluster lifecycle") step by step. The bodies of the steps
are callables the caller injects, so the same runner drives a plain-Python start in tests and the real one in
``alloy start`` (where the Serve layer provides "initialise pools" and "health-check endpoints"). Each body
receives the shared :class:`StartContext` (what earlier steps produced: settings, database, registries, ...)
and may return a short detail string for the log.

A failing step stops the sequence: the cluster goes back to STOPPED (a half-started cluster serves nothing),
the step log is persisted, and an ``AlloyError`` naming the failed step is raised (its own code when the step
raised one, SERVICE_UNAVAILABLE otherwise).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from alloy.cluster.dependencies import validate_dependencies
from alloy.cluster.state import ClusterState, ClusterStateStore, ClusterStatus, LifecycleRun, StepLogEntry
from alloy.config import ConfigHolder, config_path
from alloy.errors import AlloyError, ErrorCode
from alloy.registry.datasets import DatasetRegistry
from alloy.registry.models import ModelRegistry
from alloy.storage.artifacts import ArtifactStore
from alloy.storage.db import Database
from alloy.storage.db.types import utcnow

logger = logging.getLogger("alloy.lifecycle")

StepBody = Callable[["StartContext"], "str | None"]


@dataclass
class StartContext:
    """What the steps share. ``values`` carries what one step makes for the next (``settings``, ``db``,
    ``models``, ``datasets``, ...); ``previous`` is the cluster status found before this start."""

    mode: str
    values: dict[str, Any] = field(default_factory=dict)
    previous: ClusterStatus | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


@dataclass(frozen=True)
class Step:
    name: str
    body: StepBody | None  # None: the step is skipped (recorded as such, with ``skip_reason``)
    skip_reason: str | None = None


class StepFailed(AlloyError):
    """A start or stop step failed; ``details`` name the step and carry the step log so far."""


def run_timed(step: Step, ctx: Any, *, label: str) -> tuple[StepLogEntry, Exception | None]:
    """Run one step, log its duration and return its log entry with the exception it raised (if any)."""
    if step.body is None:
        logger.info("%s: %s skipped (%s)", label, step.name, step.skip_reason)
        return StepLogEntry(name=step.name, status="skipped", duration_s=0.0, detail=step.skip_reason), None
    started = time.perf_counter()
    try:
        detail = step.body(ctx)
    except Exception as exc:  # noqa: BLE001 - returned to the sequence, which decides
        duration = time.perf_counter() - started
        logger.error("%s: %s FAILED after %.3fs: %s", label, step.name, duration, _describe(exc))
        return StepLogEntry(name=step.name, status="failed", duration_s=round(duration, 4), detail=_describe(exc)), exc
    duration = time.perf_counter() - started
    logger.info("%s: %s ok in %.3fs%s", label, step.name, duration, f" ({detail})" if detail else "")
    return StepLogEntry(
        name=step.name, status="ok", duration_s=round(duration, 4), detail=str(detail)[:500] if detail else None
    ), None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, AlloyError):
        return f"{exc.code.value}: {exc.message}"[:1000]
    return f"{type(exc).__name__}: {exc}"[:1000]


class StartSequence:
    """An ordered list of steps ending in READY; ``run()`` returns the persisted :class:`LifecycleRun`."""

    def __init__(
        self,
        mode: str,
        steps: list[Step],
        state: ClusterStateStore | None = None,
        *,
        after_ready: list[Step] | None = None,
    ):
        self.mode = mode
        self.steps = list(steps)
        self.after_ready = list(after_ready or [])
        self.state = state

    @property
    def step_names(self) -> list[str]:
        return [s.name for s in self.steps] + ["mark READY"] + [s.name for s in self.after_ready]

    def run(self, ctx: StartContext | None = None) -> LifecycleRun:
        ctx = ctx or StartContext(mode=self.mode)
        state = self.state or ctx.get("cluster_state")
        if state is not None and ctx.previous is None:
            ctx.previous = state.begin_start(self.mode)
        started = time.perf_counter()
        log: list[StepLogEntry] = []
        total = len(self.steps) + 1
        for number, step in enumerate(self.steps, start=1):
            state = state or ctx.get("cluster_state")  # "connect registries" may be what provides it
            if state is not None and ctx.previous is None:
                ctx.previous = state.begin_start(self.mode)
            entry, error = run_timed(step, ctx, label=f"{self.mode} start step {number}/{total}")
            log.append(entry)
            if error is not None:
                raise self._abort(state, step, error, log, started) from error
        entry, error = self._mark_ready(state, ctx, total)
        log.append(entry)
        if error is not None:
            raise self._abort(state, Step("mark READY", None), error, log, started) from error
        for step in self.after_ready:
            # Work after READY (replay of interrupted jobs) never takes the cluster down: a failure is logged
            # and kept in the step log.
            log.append(run_timed(step, ctx, label=f"{self.mode} start (after READY)")[0])
        run = LifecycleRun(
            mode=self.mode, ok=True, steps=log, total_s=round(time.perf_counter() - started, 4), finished_at=utcnow()
        )
        if state is not None:
            state.record_run("start", run)
        logger.info("%s start: READY in %.3fs", self.mode, run.total_s)
        return run

    def _mark_ready(
        self, state: ClusterStateStore | None, ctx: StartContext, total: int
    ) -> tuple[StepLogEntry, Exception | None]:
        def mark(_ctx: StartContext) -> str:
            if state is None:
                return "no state store: nothing persisted"
            holder = ctx.get("config")
            version = holder.version if holder is not None and hasattr(holder, "version") else None
            state.mark_ready(config_version=version)
            return ClusterState.READY.value

        return run_timed(Step("mark READY", mark), ctx, label=f"{self.mode} start step {total}/{total}")

    def _abort(
        self, state: ClusterStateStore | None, step: Step, exc: BaseException, log: list[StepLogEntry], started: float
    ) -> AlloyError:
        message = f"{self.mode} start failed at step {step.name!r}: {_describe(exc)}"
        run = LifecycleRun(
            mode=self.mode,
            ok=False,
            steps=log,
            total_s=round(time.perf_counter() - started, 4),
            error=message,
            finished_at=utcnow(),
        )
        if state is not None:
            try:
                state.record_run("start", run)
                state.transition(ClusterState.STOPPED)
            except Exception:
                logger.warning("could not persist the failed start", exc_info=True)
        code = exc.code if isinstance(exc, AlloyError) else ErrorCode.SERVICE_UNAVAILABLE
        details: dict[str, Any] = {"step": step.name, "mode": self.mode, "steps": [e.model_dump() for e in log]}
        if isinstance(exc, AlloyError):
            details["cause"] = {"code": exc.code.value, "message": exc.message, "details": exc.details}
        return StepFailed(code, message, details)


# --- the two sequences of the specification ------------------------------------------------------------------

COLD_STEPS = (
    "load configuration",
    "validate dependencies",
    "connect registries",
    "initialise worker pools",
    "health-check endpoints",
)
WARM_STEPS = ("load configuration", "validate dependencies", "restore worker pools", "abbreviated health checks")


def cold_start(
    *,
    load_configuration: StepBody,
    validate_dependencies: StepBody,
    connect_registries: StepBody,
    initialise_pools: StepBody,
    health_check: StepBody,
    check_consistency: StepBody | None = None,
    replay: StepBody | None = None,
    state: ClusterStateStore | None = None,
) -> StartSequence:
    """Cold start: configuration -> dependencies -> registries (+ schema) -> pools -> health checks -> READY.

    ``check_consistency`` (recovery after an unclean stop) runs right after the registries are connected,
    before any pool could pick up work; ``replay`` (re-dispatching interrupted jobs) runs after READY."""
    steps = [
        Step("load configuration", load_configuration),
        Step("validate dependencies", validate_dependencies),
        Step("connect registries", connect_registries),
    ]
    if check_consistency is not None:
        steps.append(Step("consistency check", check_consistency))
    steps += [Step("initialise worker pools", initialise_pools), Step("health-check endpoints", health_check)]
    after = [Step("replay interrupted jobs", replay)] if replay is not None else []
    return StartSequence("cold", steps, state, after_ready=after)


def warm_start(
    *,
    load_configuration: StepBody,
    restore_pools: StepBody,
    health_check: StepBody,
    skip_dependency_checks: bool,
    validate_dependencies: StepBody | None = None,
    connect_registries: StepBody | None = None,
    check_consistency: StepBody | None = None,
    replay: StepBody | None = None,
    state: ClusterStateStore | None = None,
) -> StartSequence:
    """Warm start: configuration -> (dependency validation skipped when the operator confirms) -> restore pools
    from the snapshot -> abbreviated health checks -> READY.

    ``connect_registries`` is not a step of its own here (the specification's warm start has none) but the
    pools need the database: it runs inside "load configuration" when given."""

    def load(ctx: StartContext) -> str | None:
        detail = load_configuration(ctx)
        if connect_registries is not None:
            connect_registries(ctx)
        return detail

    if skip_dependency_checks:
        validate = Step("validate dependencies", None, "skipped: the operator confirmed dependencies are healthy")
    elif validate_dependencies is None:
        raise ValueError("warm start without skip_dependency_checks needs validate_dependencies")
    else:
        validate = Step("validate dependencies", validate_dependencies)
    steps = [Step("load configuration", load), validate]
    if check_consistency is not None:
        steps.append(Step("consistency check", check_consistency))
    steps += [Step("restore worker pools", restore_pools), Step("abbreviated health checks", health_check)]
    after = [Step("replay interrupted jobs", replay)] if replay is not None else []
    return StartSequence("warm", steps, state, after_ready=after)


# --- the plain-Python step bodies (the Serve layer adds pools and endpoint health checks) -------------------


def load_configuration(ctx: StartContext) -> str:
    """Step 1: read the canonical source (YAML file and environment, plus Vault when ``vault.enabled``)."""
    holder = ctx.get("config") or ConfigHolder()
    ctx["config"], ctx["settings"] = holder, holder.settings
    source = "vault + file" if holder.settings.vault.enabled else f"file {config_path()}"
    return f"{source}, profile {holder.settings.profile}, config version {holder.version}"


def dependency_validation(gpu_count: Callable[[], float] | None = None, timeout_s: float = 5.0) -> StepBody:
    """Step 2 (cold): every configured dependency, one error naming all that failed."""

    def validate(ctx: StartContext) -> str:
        report = validate_dependencies(ctx["settings"], gpu_count=gpu_count, timeout_s=timeout_s)
        ctx["dependencies"] = report
        return report.raise_for_failures().summary()

    return validate


def connect_registries(ctx: StartContext) -> str:
    """Step 3: database (schema version verified before anything is written), artifact store, ModelRegistry,
    DatasetRegistry and the cluster-state store (from here on, the start is persisted)."""
    settings = ctx["settings"]
    db = ctx.get("db") or Database.from_settings(settings)
    ctx["db"] = db
    revision = db.verify_schema()  # SCHEMA_MISMATCH names the upgrade command
    store = ctx.get("store") or ArtifactStore.from_settings(settings)
    ctx["store"] = store
    ctx["models"] = ModelRegistry.from_settings(settings, db, store)
    ctx["datasets"] = DatasetRegistry(db, store)
    ctx["cluster_state"] = ctx.get("cluster_state") or ClusterStateStore(db)
    return f"schema {revision}, store {store.uri}"
