"""Recovery after an interrupted cluster: a consistency check against the registry, its repair, and the replay
of incomplete work.

Run it at start, after the registries are connected and before any worker pool exists: then nothing is
running, so every non-terminal job was interrupted, every artifact folder without a record is a leftover of a
crashed registration, and every scratch folder is a partial merge output.

- ``check()`` finds jobs left non-terminal, artifact folders (models/, datasets/) without a record, records
  whose artifacts are missing or incomplete or (models on a local disk) whose files no longer match the sha256
  recorded at registration, staging leftovers and partial merge outputs in scratch folders.
- ``repair(report)`` requeues each job a run held (PREPARING, RUNNING, EVALUATING; history: ``interrupted`` with
  the reason; the replay's first move records ``replayed``); a CREATED job is already queued (a forced stop
  requeued it, or it never started), so one interruption counts one attempt. A merge whose output was already registered by that very job (it died
  between registration and COMPLETED) has the output unregistered first, so the rerun is idempotent. Orphan
  folders, staging leftovers and partial outputs are deleted; broken records are marked in the cluster state
  (``snapshot["recovery"]["broken_records"]``) and broken models in their record (``broken``: listed as such by
  ``GET /models`` and refused as inputs until registered again), not deleted: someone may want to restore their
  files. A model whose files verify again is unmarked.
- ``replay(dispatch)`` hands every CREATED job to the dispatcher of its kind: merges and evaluations rerun,
  evolutions resume from their last Tune checkpoint (the evolution engine restores its experiment folder). A
  kind without a dispatcher, or a dispatch that raises, ends the job FAILED with the reason.
"""

from __future__ import annotations

import logging
import posixpath
import shutil
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import select

from alloy.cluster.state import ClusterStateStore
from alloy.errors import AlloyError, ErrorCode
from alloy.jobs.liveness import requeue_lost
from alloy.jobs.records import JobKind, JobRecord, JobState
from alloy.jobs.store import JobStore
from alloy.registry.models import ModelRegistry
from alloy.storage.artifact_catalog import ArtifactCatalog
from alloy.storage.artifacts import DIR_MANIFEST, PENDING_MARKER, STAGING, ArtifactStore
from alloy.storage.db import Database
from alloy.storage.db.models import DatasetRow, ModelRow
from alloy.storage.db.types import utcnow

logger = logging.getLogger("alloy.cluster.recovery")

# The store prefixes the registries own, and the table whose rows own a folder under them.
REGISTRY_PREFIXES: dict[str, Any] = {"models": ModelRow, "datasets": DatasetRow}
DEFAULT_REASON = "interrupted: the cluster stopped before the job finished"

Dispatcher = Callable[[JobRecord], Any]


class InterruptedJob(BaseModel):
    id: str
    kind: JobKind
    state: JobState
    attempts: int
    updated_at: datetime
    output_model_id: str | None = None
    output_registered_by_job: bool = False  # a merge that died between registration and COMPLETED


class OrphanArtifact(BaseModel):
    prefix: str
    registry: str  # models | datasets
    files: int
    half_published: bool  # an S3 folder still carrying its pending marker


class BrokenRecord(BaseModel):
    registry: str  # models | datasets
    id: str
    location: str
    reason: str


class ConsistencyReport(BaseModel):
    checked_at: datetime
    interrupted_jobs: list[InterruptedJob] = Field(default_factory=list)
    orphan_artifacts: list[OrphanArtifact] = Field(default_factory=list)
    broken_records: list[BrokenRecord] = Field(default_factory=list)
    staging_leftovers: int = 0
    partial_outputs: list[str] = Field(default_factory=list)
    verified_models: list[str] = Field(default_factory=list)  # every file hashed and found as registered

    @property
    def consistent(self) -> bool:
        return not (
            self.interrupted_jobs
            or self.orphan_artifacts
            or self.broken_records
            or self.staging_leftovers
            or self.partial_outputs
        )

    def summary(self) -> str:
        return (
            f"{len(self.interrupted_jobs)} interrupted jobs, {len(self.orphan_artifacts)} orphan artifact "
            f"folders, {len(self.broken_records)} broken records, {self.staging_leftovers} staging leftovers, "
            f"{len(self.partial_outputs)} partial outputs, {len(self.verified_models)} models verified"
        )


class RepairReport(BaseModel):
    requeued: list[str] = Field(default_factory=list)
    unregistered_outputs: list[str] = Field(default_factory=list)
    orphans_deleted: list[str] = Field(default_factory=list)
    staging_removed: int = 0
    partial_outputs_removed: list[str] = Field(default_factory=list)
    broken_marked: list[str] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)

    def summary(self) -> str:
        return (
            f"requeued {len(self.requeued)}, unregistered {len(self.unregistered_outputs)} half-finished "
            f"outputs, deleted {len(self.orphans_deleted)} orphan folders and {self.staging_removed} staging "
            f"leftovers and {len(self.partial_outputs_removed)} partial outputs, marked "
            f"{len(self.broken_marked)} broken records" + (f", {len(self.errors)} errors" if self.errors else "")
        )


class ReplayOutcome(BaseModel):
    job_id: str
    kind: JobKind
    dispatched: bool
    detail: str | None = None


class ReplayReport(BaseModel):
    outcomes: list[ReplayOutcome] = Field(default_factory=list)

    @property
    def dispatched(self) -> list[str]:
        return [o.job_id for o in self.outcomes if o.dispatched]

    @property
    def failed(self) -> list[str]:
        return [o.job_id for o in self.outcomes if not o.dispatched]


class Recovery:
    def __init__(
        self,
        db: Database,
        store: ArtifactStore,
        *,
        models=None,
        state: ClusterStateStore | None = None,
        scratch_dirs: Iterable[str | Path] = (),
    ):
        self.db, self.store = db, store
        self.jobs = JobStore(db)
        self.models = models or ModelRegistry(db, store)
        self.catalog = ArtifactCatalog(db, store)
        self.state = state
        self.scratch_dirs = [Path(d) for d in scratch_dirs]

    # -- check ----------------------------------------------------------------------------------------------
    def check(self) -> ConsistencyReport:
        report = ConsistencyReport(
            checked_at=utcnow(),
            interrupted_jobs=self._interrupted_jobs(),
            staging_leftovers=self._staging_count(),
            partial_outputs=[str(p) for d in self.scratch_dirs if d.is_dir() for p in sorted(d.iterdir())],
        )
        for registry, table in REGISTRY_PREFIXES.items():
            owned = self._recorded_prefixes(table)
            files = self._files_under(registry)
            report.orphan_artifacts += _orphans(registry, files, owned)
            report.broken_records += self._broken(registry, table)
        report.broken_records += self._damaged_models(report)
        logger.info("consistency check: %s", report.summary())
        return report

    def _interrupted_jobs(self) -> list[InterruptedJob]:
        found = []
        for job in self.jobs.active():
            output = job.request.get("output_model_id") if job.kind is JobKind.MERGE else None
            found.append(
                InterruptedJob(
                    id=job.id,
                    kind=job.kind,
                    state=job.state,
                    attempts=job.attempts,
                    updated_at=job.updated_at,
                    output_model_id=output,
                    output_registered_by_job=output is not None and self._registered_by(output, job.id),
                )
            )
        return found

    def _registered_by(self, model_id: str, job_id: str) -> bool:
        with self.db.session() as session:
            row = session.get(ModelRow, model_id)
            return row is not None and (row.lineage or {}).get("job_id") == job_id

    def _staging_count(self) -> int:
        base = f"{self.store.root}/{STAGING}"
        return len(self.store.fs.ls(base)) if self.store.fs.exists(base) else 0

    def _files_under(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (markers and manifests included), key -> size."""
        base = f"{self.store.root}/{prefix}"
        if not self.store.fs.exists(base):
            return {}
        root = self.store.fs._strip_protocol(self.store.root)
        return {
            self.store.fs._strip_protocol(path)[len(root) + 1 :]: int(entry.get("size") or 0)
            for path, entry in self.store.fs.find(base, detail=True).items()
            if entry["type"] == "file"
        }

    def _recorded_prefixes(self, table) -> set[str]:
        with self.db.session() as session:
            return {p for p in session.scalars(select(table.artifact_prefix)).all() if p}

    def _broken(self, registry: str, table) -> list[BrokenRecord]:
        with self.db.session() as session:
            rows = [(r.id, r.artifact_prefix, getattr(r, "source_path", None)) for r in session.scalars(select(table))]
        broken = []
        for record_id, prefix, source_path in rows:
            if source_path:  # registered in place: the folder itself must still be there
                if not Path(source_path).is_dir():
                    broken.append(
                        BrokenRecord(
                            registry=registry,
                            id=record_id,
                            location=source_path,
                            reason="the registered folder is missing",
                        )
                    )
                continue
            reason = self._folder_problem(prefix) if prefix else "no artifact location recorded"
            if reason:
                broken.append(BrokenRecord(registry=registry, id=record_id, location=prefix or "", reason=reason))
        return broken

    def _damaged_models(self, report: ConsistencyReport) -> list[BrokenRecord]:
        """Models whose files are all there but no longer what was registered (every file hashed afresh: the
        consistency check trusts nothing remembered). Files on S3 are verified when a node downloads them."""
        already = {b.id for b in report.broken_records if b.registry == "models"}
        with self.db.session() as session:
            rows = [(r.id, r.artifact_prefix or r.source_path or "") for r in session.scalars(select(ModelRow))]
        damaged = []
        for model_id, location in rows:
            if model_id in already:
                continue
            try:
                reason = self.models.verify(model_id)
            except Exception as exc:  # noqa: BLE001 - one unreadable model must not stop the check
                reason = f"its files cannot be verified: {type(exc).__name__}: {exc}"
            if reason is None:
                if self.store.is_local or location.startswith("/"):
                    report.verified_models.append(model_id)
                continue
            damaged.append(BrokenRecord(registry="models", id=model_id, location=location, reason=reason))
        return damaged

    def _folder_problem(self, prefix: str) -> str | None:
        """Why a published folder is not complete, or None: its manifest must exist, no pending marker may
        remain, and every file the manifest lists must be there with its size."""
        files = self._files_under(prefix)
        if f"{prefix}/{PENDING_MARKER}" in files:
            return "the folder was never completely published (pending marker present)"
        if f"{prefix}/{DIR_MANIFEST}" not in files:
            return "the artifact folder is missing" if not files else "the folder manifest is missing"
        for info in self.store.dir_manifest(prefix):
            if info.key not in files:
                return f"file {info.key!r} is missing"
            if files[info.key] != info.size:
                return f"file {info.key!r} has {files[info.key]} bytes, the manifest says {info.size}"
        return None

    # -- repair ---------------------------------------------------------------------------------------------
    def repair(self, report: ConsistencyReport, *, reason: str = DEFAULT_REASON) -> RepairReport:
        repaired = RepairReport()
        for job in report.interrupted_jobs:
            self._requeue(job, reason, repaired)
        for orphan in report.orphan_artifacts:
            try:
                self.store.delete_prefix(orphan.prefix)
                self.catalog.forget_prefix(orphan.prefix)
                repaired.orphans_deleted.append(orphan.prefix)
            except Exception as exc:  # noqa: BLE001 - one stuck folder must not stop the others
                repaired.errors.append(f"delete {orphan.prefix}: {exc}")
        if report.staging_leftovers:
            repaired.staging_removed = self.store.gc_staging(older_than_s=0)
        for partial in report.partial_outputs:
            shutil.rmtree(partial, ignore_errors=True)
            repaired.partial_outputs_removed.append(partial)
        repaired.broken_marked = [f"{b.registry}/{b.id}" for b in report.broken_records]
        self._mark_models(report, repaired)
        if self.state is not None:
            self.state.update_snapshot(
                recovery={
                    "checked_at": report.checked_at.isoformat(),
                    "summary": report.summary(),
                    "repair": repaired.summary(),
                    "broken_records": [b.model_dump() for b in report.broken_records],
                }
            )
        logger.info("repair: %s", repaired.summary())
        return repaired

    def _mark_models(self, report: ConsistencyReport, repaired: RepairReport) -> None:
        """Broken models are refused as inputs (their record says why); verified ones are usable again."""
        for broken in report.broken_records:
            if broken.registry == "models":
                self.models.set_broken(broken.id, f"{broken.reason} (found by the start-up consistency check)")
        for model_id in report.verified_models:
            self.models.set_broken(model_id, None)

    def _requeue(self, job: InterruptedJob, reason: str, repaired: RepairReport) -> None:
        try:
            if job.output_registered_by_job and job.output_model_id:
                # The merge registered its output and died before COMPLETED: its rerun must find the id free.
                self.models.delete(job.output_model_id)
                repaired.unregistered_outputs.append(job.output_model_id)
            if requeue_lost(self.jobs, self.jobs.get(job.id), f"{reason} (was {job.state.value})") is not None:
                repaired.requeued.append(job.id)
        except AlloyError as exc:
            repaired.errors.append(f"requeue {job.id}: {exc.message}")

    # -- replay ---------------------------------------------------------------------------------------------
    def replay(self, dispatch: Mapping[JobKind | str, Dispatcher]) -> ReplayReport:
        """Dispatch every CREATED job (requeued ones and ones whose first dispatch was lost), oldest first."""
        by_kind = {JobKind(kind): fn for kind, fn in dispatch.items()}
        report = ReplayReport()
        for job in self.jobs.active():
            if job.state is not JobState.CREATED:
                continue
            dispatcher = by_kind.get(job.kind)
            if dispatcher is None:
                self._fail_replay(job, f"replay impossible: no {job.kind.value} engine is deployed", report)
                continue
            try:
                dispatcher(job)
            except Exception as exc:  # noqa: BLE001 - recorded on the job: it ends FAILED with the reason
                self._fail_replay(job, f"replay dispatch failed: {type(exc).__name__}: {exc}", report)
                continue
            report.outcomes.append(
                ReplayOutcome(job_id=job.id, kind=job.kind, dispatched=True, detail=f"attempt {job.attempts + 1}")
            )
        logger.info("replay: %d dispatched, %d failed", len(report.dispatched), len(report.failed))
        return report

    def _fail_replay(self, job: JobRecord, message: str, report: ReplayReport) -> None:
        try:
            self.jobs.fail(job.id, ErrorCode.SERVICE_UNAVAILABLE, message)
        except AlloyError:
            pass  # it moved meanwhile (an engine's sweeper picked it up): nothing to record
        report.outcomes.append(ReplayOutcome(job_id=job.id, kind=job.kind, dispatched=False, detail=message))


def _orphans(registry: str, files: dict[str, int], owned: set[str]) -> list[OrphanArtifact]:
    """Group the keys under a registry prefix into folders no record owns. A folder is the nearest ancestor
    holding a folder manifest or pending marker; a stray object outside any folder is its own orphan."""
    folders: dict[str, OrphanArtifact] = {}
    for key in files:
        if any(key == p or key.startswith(p + "/") for p in owned):
            continue
        folder = _folder_of(key, files)
        entry = folders.setdefault(
            folder, OrphanArtifact(prefix=folder, registry=registry, files=0, half_published=False)
        )
        if posixpath.basename(key) == PENDING_MARKER:
            entry.half_published = True
        elif posixpath.basename(key) != DIR_MANIFEST:
            entry.files += 1
    return sorted(folders.values(), key=lambda o: o.prefix)


def _folder_of(key: str, files: dict[str, int]) -> str:
    parts = key.split("/")
    for end in range(2, len(parts)):  # nearest-to-root folder marker wins ("models/org/name" over a subfolder)
        candidate = "/".join(parts[:end])
        if f"{candidate}/{DIR_MANIFEST}" in files or f"{candidate}/{PENDING_MARKER}" in files:
            return candidate
    return posixpath.dirname(key) if "/" in key[len(parts[0]) + 1 :] else key
