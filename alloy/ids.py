"""Identifier and path rules for everything a client names: model and dataset IDs, and local source paths.

Resource IDs end up in URLs, database keys, artifact-store prefixes and file names, so they are held to one
narrow rule: ``name`` or ``org/name`` (Hugging Face style), where ``name`` is 1-128 characters and ``org`` 1-31
characters of ``A-Z a-z 0-9 . _ -``, each starting with a letter or digit, and no ``..`` anywhere. Whole ID at
most 160 characters (``alloy.storage.db.models.ID_LENGTH``). That excludes path traversal, absolute paths, backslashes,
whitespace, control characters and URL metacharacters by construction.

Use :data:`ResourceId` in pydantic/FastAPI models (a bad ID is a 422 VALIDATION_FAILED naming the field) and
:func:`validate_resource_id` elsewhere. :func:`confined_path` resolves a client-supplied local path and refuses
anything outside the allowed roots (symlinks resolved first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, StringConstraints

from alloy.errors import AlloyError, ErrorCode

MAX_NAME_LENGTH = 128
MAX_ORG_LENGTH = 31
MAX_ID_LENGTH = MAX_ORG_LENGTH + 1 + MAX_NAME_LENGTH  # 160, the width of the id columns

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]"
RESOURCE_ID_PATTERN = rf"^(?:{_SEGMENT}{{0,{MAX_ORG_LENGTH - 1}}}/)?{_SEGMENT}{{0,{MAX_NAME_LENGTH - 1}}}$"
_RESOURCE_ID = re.compile(RESOURCE_ID_PATTERN)


def resource_id_problem(value: object) -> str | None:
    """Why ``value`` is not a valid resource ID, or None when it is."""
    if not isinstance(value, str):
        return "must be a string"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"must be at most {MAX_ID_LENGTH} characters"
    if ".." in value:
        return "must not contain '..'"
    if not _RESOURCE_ID.fullmatch(value):
        return (
            "must be 'name' or 'org/name': letters, digits, '.', '_' and '-', each part starting with a letter "
            f"or digit (name at most {MAX_NAME_LENGTH}, org at most {MAX_ORG_LENGTH} characters)"
        )
    return None


def validate_resource_id(value: object, kind: str = "model") -> str:
    """Return ``value`` if it is a valid ID for a ``kind`` (model, dataset, ...); else raise VALIDATION_FAILED."""
    problem = resource_id_problem(value)
    if problem is not None:
        shown = value[:200] if isinstance(value, str) else type(value).__name__
        raise AlloyError(
            ErrorCode.VALIDATION_FAILED,
            f"invalid {kind} id {shown!r}: {problem}",
            {"field": f"{kind}_id", "reason": problem},
        )
    return value  # type: ignore[return-value]


def _check_resource_id(value: str) -> str:
    problem = resource_id_problem(value)
    if problem is not None:
        raise ValueError(f"invalid id: {problem}")  # pydantic turns this into a per-field validation error
    return value


# The JSON-schema pattern and length keep the OpenAPI document (and clients generated from it) honest; the
# after-validator adds the rule a regex cannot say simply (no "..").
ResourceId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_ID_LENGTH, pattern=RESOURCE_ID_PATTERN),
    AfterValidator(_check_resource_id),
]


# A merge input: a model id, or ``base-id+adapter-id`` (a registered model with a registered LoRA adapter folded in;
# ids never contain ``+``). Each part follows the id rule.
MODEL_REFERENCE_PATTERN = rf"^{RESOURCE_ID_PATTERN[1:-1]}(?:\+{RESOURCE_ID_PATTERN[1:-1]})?$"


def _check_model_reference(value: str) -> str:
    for part in value.split("+"):
        _check_resource_id(part)
    return value


ModelReference = Annotated[
    str,
    StringConstraints(min_length=1, max_length=2 * MAX_ID_LENGTH + 1, pattern=MODEL_REFERENCE_PATTERN),
    AfterValidator(_check_model_reference),
]


# Free text and paths a client sends (a source path, a reason, a filter): bounded, and without control characters
# (NUL included). They reach logs, file-system calls and database columns (PostgreSQL refuses NUL in text), so
# they are refused at the boundary (422 VALIDATION_FAILED), and the OpenAPI document says so with this pattern.
NO_CONTROL_CHARACTERS = r"^[^\x00-\x1f\x7f]*$"
SPLIT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a dataset split's name: "train", "dev", "test-2"
MAX_TEXT_LENGTH = 200
MAX_PATH_LENGTH = 1024  # a client's part of a path; the root it is resolved under must fit in PATH_MAX with it
MAX_PATH_BYTES = 4095  # PATH_MAX less the NUL

MAX_NAME_BYTES = 255  # a path component (NAME_MAX): a longer one is ENAMETOOLONG in every file-system call

ShortText = Annotated[str, StringConstraints(max_length=MAX_TEXT_LENGTH, pattern=NO_CONTROL_CHARACTERS)]
# A local path or an artifact URI: printable ASCII (so characters are bytes and NAME_MAX is a length the schema
# can state), each component at most 255 of them, the whole at most 1024.
_PATH_COMPONENT = rf"[\x20-\x2e\x30-\x7e]{{0,{MAX_NAME_BYTES}}}"
SOURCE_PATH_PATTERN = rf"^(?:{_PATH_COMPONENT}/)*{_PATH_COMPONENT}$"
SourcePath = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_LENGTH, pattern=SOURCE_PATH_PATTERN)]


def expand_home(text: str | os.PathLike[str]) -> Path:
    """A client's local path with a leading ``~`` or ``~user`` expanded where that home exists, else as written.
    WHY not ``Path.expanduser``: it raises RuntimeError for an unknown user (``~w,:d/x`` from the fuzzer was a 500)."""
    return Path(os.path.expanduser(os.fspath(text)))


def confined_path(
    candidate: str | os.PathLike[str], roots: Iterable[str | os.PathLike[str]], *, kind: str = "path"
) -> Path:
    """Resolve ``candidate`` (symlinks included) and return it if it lies inside one of ``roots``.

    Relative candidates are taken relative to each root in turn. Raise VALIDATION_FAILED otherwise, naming the
    allowed roots (the operator configured them for clients to use) and nothing else of the file system: not
    where the candidate resolved to.
    """
    text = os.fspath(candidate)
    too_long = any(len(os.fsencode(part)) > MAX_NAME_BYTES for part in text.split("/"))
    if not text or "\x00" in text or too_long:
        raise AlloyError(ErrorCode.VALIDATION_FAILED, f"invalid {kind}", {"field": kind})
    allowed = [Path(root).resolve() for root in roots]
    for root_path in allowed:
        resolved = (root_path / text).resolve()  # an absolute candidate replaces root_path here
        if len(os.fsencode(resolved)) > MAX_PATH_BYTES:  # ENAMETOOLONG for every file-system call
            raise AlloyError(ErrorCode.VALIDATION_FAILED, f"invalid {kind}: too long", {"field": kind})
        if resolved == root_path or root_path in resolved.parents:
            return resolved
    raise outside_roots(kind, allowed)


def outside_roots(kind: str, roots: Iterable[str | os.PathLike[str]]) -> AlloyError:
    """VALIDATION_FAILED for a path outside every allowed root, naming the roots."""
    names = [str(root) for root in roots]
    return AlloyError(
        ErrorCode.VALIDATION_FAILED,
        f"{kind} is outside the allowed folders ({', '.join(names) or 'none configured'})",
        {"field": kind, "reason": "not under an allowed root", "allowed_roots": names},
    )
