"""Persistence: the database connection, its ORM tables and migrations."""

from alloy.storage.db.database import UPGRADE_COMMAND, Database, normalize_url
from alloy.storage.db.page import Page

__all__ = ["Database", "Page", "UPGRADE_COMMAND", "normalize_url"]
