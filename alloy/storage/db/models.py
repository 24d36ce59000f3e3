"""The ORM tables of Alloy. The Alembic migrations in ``alloy/db/migrations/versions`` create exactly these;
change both together (``alloy db upgrade`` applies the migrations)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from alloy.storage.db.types import PortableJSON, UTCDateTime, utcnow

ID_LENGTH = 160  # model/dataset ids: 128 characters plus an optional "org/" part


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: PortableJSON, list[Any]: PortableJSON, datetime: UTCDateTime}


class ModelRow(Base):
    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    architecture: Mapped[str | None] = mapped_column(String(200))
    model_type: Mapped[str | None] = mapped_column(String(100))
    dtypes: Mapped[list[Any]] = mapped_column(PortableJSON, default=list)
    parameter_count: Mapped[int] = mapped_column(BigInteger)
    num_layers: Mapped[int | None] = mapped_column(Integer)
    hidden_size: Mapped[int | None] = mapped_column(Integer)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    shards: Mapped[list[Any]] = mapped_column(PortableJSON, default=list)
    tensor_count: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # Where the files live: an ArtifactStore prefix, or (copy_into_store=False) a local folder.
    artifact_prefix: Mapped[str | None] = mapped_column(String(512))
    source_path: Mapped[str | None] = mapped_column(Text)
    # The full manifest (tensors name -> shape/dtype/shard, config.json) for manifest(id).
    manifest: Mapped[dict[str, Any]] = mapped_column(PortableJSON)
    owner: Mapped[str | None] = mapped_column(String(128), index=True)
    lineage: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Integrity: each file's size and sha256 at registration (name -> {size, sha256}), checked before reads;
    # why the model cannot be used (damaged or missing files), or NULL when it can.
    files: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    broken: Mapped[str | None] = mapped_column(Text)


class DatasetRow(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    description: Mapped[str | None] = mapped_column(Text)
    task: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    # field name -> arrow type string
    schema_fields: Mapped[dict[str, Any]] = mapped_column("schema", PortableJSON)
    # split name -> {"rows", "key", "size", "sha256", "source_format"}
    splits: Mapped[dict[str, Any]] = mapped_column(PortableJSON)
    row_count: Mapped[int] = mapped_column(BigInteger)
    artifact_prefix: Mapped[str] = mapped_column(String(512))
    owner: Mapped[str | None] = mapped_column(String(128), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


# The states a job holds its output claim in (alloy.jobs.store.NON_TERMINAL_STATES, spelled out here because the
# index predicate is SQL and the migration that created it must not change with the code).
ACTIVE_JOB_STATES_SQL = "state NOT IN ('COMPLETED', 'FAILED')"
OUTPUT_CLAIM_INDEX = "uq_jobs_active_output"


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_kind", "state", "kind"),
        # The output claim: at most one active job per output model id. A partial unique index, so a job that
        # FAILS frees its id at once (the row leaves the predicate) and a COMPLETED one hands it to the registry.
        Index(
            OUTPUT_CLAIM_INDEX,
            "output_model_id",
            unique=True,
            sqlite_where=text(ACTIVE_JOB_STATES_SQL),
            postgresql_where=text(ACTIVE_JOB_STATES_SQL),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(32))
    progress: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    request: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    owner: Mapped[str | None] = mapped_column(String(128), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # incremented by each requeue
    # The model id the job will register (merges); NULL for jobs that register nothing under a chosen id.
    output_model_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class JobEventRow(Base):
    """Job history: one row per state change, interruption or replay."""

    __tablename__ = "job_events"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(32))  # created | transition | interrupted | replayed | failed
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str | None] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ExperimentRow(Base):
    __tablename__ = "experiments"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    owner: Mapped[str | None] = mapped_column(String(128), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class ExperimentRecordRow(Base):
    """One metric result of one model on one dataset split."""

    __tablename__ = "experiment_records"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment_id: Mapped[str] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    dataset_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    split: Mapped[str | None] = mapped_column(String(64))
    metric: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float | None] = mapped_column(Float)
    lsn: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TrialRow(Base):
    """One evolution candidate."""

    __tablename__ = "trials"
    __table_args__ = (Index("ix_trials_experiment_generation", "experiment_id", "generation"),)

    experiment_id: Mapped[str] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)
    trial_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer)
    genome: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    recipe: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(PortableJSON, default=dict)
    parent_trial: Mapped[str | None] = mapped_column(String(128))
    lsn: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ArtifactRow(Base):
    __tablename__ = "artifacts"

    key: Mapped[str] = mapped_column(String(1024), primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[str | None] = mapped_column(String(32), index=True)  # model | dataset | merge-output | ...
    owner: Mapped[str | None] = mapped_column(String(128), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKeyRow(Base):
    """API keys; the secret itself is never stored, only its hash (owned by ``alloy.storage.keys.ApiKeyStore``)."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    secret_hash: Mapped[str] = mapped_column(String(256))
    scopes: Mapped[list[Any]] = mapped_column(PortableJSON, default=list)
    read_limit: Mapped[str | None] = mapped_column(String(64))  # limits notation, e.g. "100/minute"
    jobs_limit: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rotated_from: Mapped[str | None] = mapped_column(String(64))
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ClusterStateRow(Base):
    """A single row (id 1): the cluster lifecycle state and the worker-pool snapshot for warm starts."""

    __tablename__ = "cluster_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    state: Mapped[str] = mapped_column(String(32))
    config_version: Mapped[int] = mapped_column(Integer, default=1)
    snapshot: Mapped[dict[str, Any] | None] = mapped_column(PortableJSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TrackerLogRow(Base):
    """One row per tracker flush that wrote something; its id is the log sequence number."""

    __tablename__ = "tracker_log"
    __table_args__ = {"sqlite_autoincrement": True}

    lsn: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    records: Mapped[int] = mapped_column(Integer)
    trials: Mapped[int] = mapped_column(Integer)
    flushed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
