"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Every table of the first release. Types are spelled with plain SQLAlchemy types (not alloy.storage.db.types) so that
this file stays valid whatever the application code later becomes.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# JSONB on PostgreSQL, JSON text on SQLite (same as alloy.storage.db.types.PortableJSON).
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("secret_hash", sa.String(length=256), nullable=False),
        sa.Column("scopes", JSON_TYPE, nullable=False),
        sa.Column("read_limit", sa.String(length=64), nullable=True),
        sa.Column("jobs_limit", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rotated_from", sa.String(length=64), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id"),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_owner"), ["owner"], unique=False)

    op.create_table(
        "artifacts",
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=True),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_artifacts_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_artifacts_owner"), ["owner"], unique=False)

    op.create_table(
        "cluster_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("config_version", sa.Integer(), nullable=False),
        sa.Column("snapshot", JSON_TYPE, nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=160), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("task", JSON_TYPE, nullable=True),
        sa.Column("schema", JSON_TYPE, nullable=False),
        sa.Column("splits", JSON_TYPE, nullable=False),
        sa.Column("row_count", sa.BigInteger(), nullable=False),
        sa.Column("artifact_prefix", sa.String(length=512), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_datasets_owner"), ["owner"], unique=False)

    op.create_table(
        "experiments",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("params", JSON_TYPE, nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_experiments_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_experiments_owner"), ["owner"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("progress", JSON_TYPE, nullable=False),
        sa.Column("request", JSON_TYPE, nullable=False),
        sa.Column("result", JSON_TYPE, nullable=True),
        sa.Column("error", JSON_TYPE, nullable=True),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_owner"), ["owner"], unique=False)
        batch_op.create_index("ix_jobs_state_kind", ["state", "kind"], unique=False)

    op.create_table(
        "models",
        sa.Column("id", sa.String(length=160), nullable=False),
        sa.Column("architecture", sa.String(length=200), nullable=True),
        sa.Column("model_type", sa.String(length=100), nullable=True),
        sa.Column("dtypes", JSON_TYPE, nullable=False),
        sa.Column("parameter_count", sa.BigInteger(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=True),
        sa.Column("hidden_size", sa.Integer(), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("shards", JSON_TYPE, nullable=False),
        sa.Column("tensor_count", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("artifact_prefix", sa.String(length=512), nullable=True),
        sa.Column("source_path", sa.Text(), nullable=True),
        sa.Column("manifest", JSON_TYPE, nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("lineage", JSON_TYPE, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_models_fingerprint"), ["fingerprint"], unique=False)
        batch_op.create_index(batch_op.f("ix_models_owner"), ["owner"], unique=False)

    op.create_table(
        "tracker_log",
        sa.Column("lsn", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("flushed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("lsn"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "experiment_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("experiment_id", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=160), nullable=False),
        sa.Column("dataset_id", sa.String(length=160), nullable=True),
        sa.Column("split", sa.String(length=64), nullable=True),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("lsn", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("experiment_records", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_experiment_records_experiment_id"), ["experiment_id"], unique=False)

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("from_state", sa.String(length=32), nullable=True),
        sa.Column("to_state", sa.String(length=32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("details", JSON_TYPE, nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_events_job_id"), ["job_id"], unique=False)

    op.create_table(
        "trials",
        sa.Column("experiment_id", sa.String(length=64), nullable=False),
        sa.Column("trial_id", sa.String(length=128), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("genome", JSON_TYPE, nullable=False),
        sa.Column("recipe", JSON_TYPE, nullable=False),
        sa.Column("metrics", JSON_TYPE, nullable=False),
        sa.Column("parent_trial", sa.String(length=128), nullable=True),
        sa.Column("lsn", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("experiment_id", "trial_id"),
    )


def downgrade() -> None:
    op.drop_table("trials")
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_events_job_id"))

    op.drop_table("job_events")
    with op.batch_alter_table("experiment_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_experiment_records_experiment_id"))

    op.drop_table("experiment_records")
    op.drop_table("tracker_log")
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_models_owner"))
        batch_op.drop_index(batch_op.f("ix_models_fingerprint"))

    op.drop_table("models")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_state_kind")
        batch_op.drop_index(batch_op.f("ix_jobs_owner"))
        batch_op.drop_index(batch_op.f("ix_jobs_created_at"))

    op.drop_table("jobs")
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_experiments_owner"))
        batch_op.drop_index(batch_op.f("ix_experiments_created_at"))

    op.drop_table("experiments")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_datasets_owner"))

    op.drop_table("datasets")
    op.drop_table("cluster_state")
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_artifacts_owner"))
        batch_op.drop_index(batch_op.f("ix_artifacts_kind"))

    op.drop_table("artifacts")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_owner"))

    op.drop_table("api_keys")
