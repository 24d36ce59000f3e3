"""Resource identifiers of the registries.

A model or dataset id is ``name`` or ``org/name`` (Hugging Face style), each part matching
``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``. Ids are case-sensitive and double as artifact prefixes
(``models/<id>/``, ``datasets/<id>/``), which is why ``..``-like parts cannot occur (a part starts with a letter
or digit) and why ``org`` and ``org/name`` may not both exist (one folder would contain the other).
"""

from __future__ import annotations

import re

from alloy.errors import validation_failed

ID_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ID_PATTERN = re.compile(rf"{ID_PART}(/{ID_PART})?")


def check_id(kind: str, identifier: str) -> str:
    if not isinstance(identifier, str) or not ID_PATTERN.fullmatch(identifier):
        raise validation_failed(
            f"invalid {kind} id {identifier!r}: use 'name' or 'org/name', each part "
            "[A-Za-z0-9][A-Za-z0-9._-]{0,127}",
            **{f"{kind}_id": identifier},
        )
    return identifier


def namespace_clashes(identifier: str) -> list[str]:
    """Ids that would nest with ``identifier`` as folders: its org, or (for a bare name) ``name/...``."""
    return [identifier.split("/", 1)[0]] if "/" in identifier else []
