"""The multi-node storage rule: a cluster of more than one node needs storage every node sees."""

from __future__ import annotations

from alloy.config import Settings
from alloy.errors import AlloyError, ErrorCode


def check_storage_for_cluster(settings: Settings, alive_nodes: int) -> None:
    """More than one node needs shared storage: a SQLite database or a local artifact folder would be seen by
    one node only, so jobs would vanish or models would be missing on the others. Refuse at startup."""
    if alive_nodes <= 1:
        return
    problems = []
    if settings.database_url.startswith("sqlite"):
        problems.append(f"database.url is SQLite ({settings.database_url}); use PostgreSQL")
    if "://" not in settings.artifacts_uri or settings.artifacts_uri.startswith("file://"):
        problems.append(f"artifacts.uri is a local folder ({settings.artifacts_uri}); use s3://bucket/prefix")
    if problems:
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"this Ray cluster has {alive_nodes} nodes, which needs shared storage: " + "; ".join(problems),
            {"alive_nodes": alive_nodes, "problems": problems},
        )
