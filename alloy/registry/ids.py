"""Registry-specific identifier rules, on top of the one ID rule in :mod:`alloy.ids`.

Ids double as artifact prefixes (``models/<id>/``, ``datasets/<id>/``), so ``org`` and ``org/name`` may not both
exist (one folder would contain the other).
"""

from __future__ import annotations

from alloy.ids import validate_resource_id


def check_id(kind: str, identifier: str) -> str:
    return validate_resource_id(identifier, kind)


def namespace_clashes(identifier: str) -> list[str]:
    """Ids that would nest with ``identifier`` as folders: its org, or (for a bare name) ``name/...``."""
    return [identifier.split("/", 1)[0]] if "/" in identifier else []
