"""Disk space: checked before a merge writes (the output size is known from its plan), and the one error of a
disk that is (or gets) full: ``INSUFFICIENT_STORAGE`` (HTTP 507), for HTTP jobs and ``alloy merge`` alike.

The check asks for the output's bytes plus a margin (2 % and 64 MiB: headers, config and tokenizer files, the
filesystem's own overhead) on every disk the merge writes to; two places on one disk add up (a merge's work
folder and a local artifact store, into which the output is copied when it is registered). A disk that fills
up anyway during the write (another writer) raises ``OSError(ENOSPC)``: :func:`storage_error` turns that into
the same code.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alloy.errors import AlloyError, ErrorCode

MARGIN_FRACTION = 0.02
MARGIN_BYTES = 64 * 1024**2
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True)
class SpaceNeed:
    path: Path  # where it will be written (need not exist yet)
    bytes: int
    what: str  # how an error names the place, e.g. "the merge work folder" (never a server path)


def merge_output_bytes(recipe: Any, sources: Mapping[str, Any]) -> int:
    """The bytes of the tensors a merge of ``recipe`` over ``sources`` (model id -> folder or LoRA source)
    writes, from its plan (headers only: no weight is read)."""
    # lazy: alloy.merge (torch) only for the callers that merge
    from alloy.merge.executor import prepare
    from alloy.merge.lora import model_folder
    from alloy.model_manifest import read_manifest

    manifests = {m: read_manifest(model_folder(sources[m])) for m in recipe.model_ids}
    plan = prepare(recipe, manifests)
    return sum(math.prod(task.shape) * task.dtype.itemsize for task in plan.tasks)


def require_free_space(needs: list[SpaceNeed], *, name_paths: bool = False) -> None:
    """INSUFFICIENT_STORAGE unless every disk has room for what will be written to it (plus the margin).
    ``name_paths``: the message names the folders (for a local command, never for an HTTP client)."""
    by_disk: dict[int, list[SpaceNeed]] = {}
    anchors: dict[int, Path] = {}
    for need in needs:
        anchor = _existing_ancestor(need.path)
        device = os.stat(anchor).st_dev
        by_disk.setdefault(device, []).append(need)
        anchors.setdefault(device, anchor)
    for device, group in by_disk.items():
        wanted = sum(n.bytes for n in group)
        required = int(wanted * (1 + MARGIN_FRACTION)) + MARGIN_BYTES
        free = shutil.disk_usage(anchors[device]).free
        if free < required:
            places = " and ".join(f"{n.what} ({n.path})" if name_paths else n.what for n in group)
            verb = "need" if len(group) > 1 else "needs"
            shared = " (one disk)" if len(group) > 1 else ""
            raise AlloyError(
                ErrorCode.INSUFFICIENT_STORAGE,
                f"not enough free disk space: {places}{shared} {verb} {_gb(required)} for the merge output "
                f"({_gb(wanted)} plus a margin), {_gb(free)} is free",
                {"required_bytes": required, "free_bytes": free, "places": [n.what for n in group]},
            )


def storage_error(exc: BaseException, what: str) -> AlloyError | None:
    """INSUFFICIENT_STORAGE for an ``OSError`` of a full disk or an exhausted quota (None for anything else)."""
    if isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS:
        return AlloyError(
            ErrorCode.INSUFFICIENT_STORAGE,
            f"the disk of {what} filled up while writing: {os.strerror(exc.errno)}; nothing was kept",
            {"errno": errno.errorcode.get(exc.errno, str(exc.errno))},
        )
    return None


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gb(count: int) -> str:
    return f"{count / 1e9:.2f} GB"
