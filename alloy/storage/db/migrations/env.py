"""Alembic environment. Alloy runs migrations programmatically (``Database.upgrade`` / ``alloy db upgrade``),
handing its engine over through ``config.attributes["engine"]``; plain ``alembic`` use falls back to the
``sqlalchemy.url`` option."""

from alembic import context
from sqlalchemy import create_engine

from alloy.storage.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine") or create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",  # SQLite needs batch mode for ALTER
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
