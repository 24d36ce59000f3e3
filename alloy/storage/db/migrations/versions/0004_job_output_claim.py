"""claim a merge's output model id in the database

``jobs.output_model_id`` and a partial unique index over the active jobs (``state NOT IN ('COMPLETED',
'FAILED')``): two concurrent submissions for one output id cannot both be accepted, a FAILED job frees the id at
once, and a COMPLETED one has handed it to the model registry (whose primary key keeps it taken).

The upgrade backfills the column from the active merge jobs' requests. A database written before this revision
may hold several active merges of one output (the race this revision closes): the oldest keeps the claim, the
others stay unclaimed (they will fail at registration, as they would have before).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ACTIVE = "state NOT IN ('COMPLETED', 'FAILED')"
INDEX = "uq_jobs_active_output"


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output_model_id", sa.String(length=160), nullable=True))
    _backfill()
    op.create_index(
        INDEX,
        "jobs",
        ["output_model_id"],
        unique=True,
        sqlite_where=sa.text(ACTIVE),
        postgresql_where=sa.text(ACTIVE),
    )


def _backfill() -> None:
    bind = op.get_bind()
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        sa.column("kind", sa.String),
        sa.column("state", sa.String),
        sa.column("request", sa.JSON),
        sa.column("created_at", sa.DateTime),
        sa.column("output_model_id", sa.String),
    )
    rows = bind.execute(
        sa.select(jobs.c.id, jobs.c.request)
        .where(jobs.c.kind == "merge", jobs.c.state.not_in(["COMPLETED", "FAILED"]))
        .order_by(jobs.c.created_at, jobs.c.id)
    ).all()
    claimed: set[str] = set()
    for job_id, request in rows:
        if isinstance(request, str):  # JSON text on some drivers
            request = json.loads(request)
        output = (request or {}).get("output_model_id")
        if not isinstance(output, str) or not output or output in claimed:
            continue
        claimed.add(output)
        bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(output_model_id=output))


def downgrade() -> None:
    op.drop_index(INDEX, table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("output_model_id")
