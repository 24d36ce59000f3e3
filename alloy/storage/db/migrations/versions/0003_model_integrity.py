"""model integrity: each file's recorded size and sha256, and why a model is broken

A model's files are verified against ``files`` before they are read; ``broken`` (NULL when fine) says why a
model is refused as an input until it is registered again.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.add_column(sa.Column("files", JSON_TYPE, nullable=True))
        batch_op.add_column(sa.Column("broken", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_column("broken")
        batch_op.drop_column("files")
