"""index trials by generation

Evolution reads a generation's trials (best/median per generation) on every progress report.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_trials_experiment_generation", "trials", ["experiment_id", "generation"])


def downgrade() -> None:
    op.drop_index("ix_trials_experiment_generation", table_name="trials")
