"""Local writes that survive a power loss: files fsynced before they are renamed into place, and the folders
whose entries (and renames) must be durable before a database commit refers to them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable


def write_file(path: str, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` and fsync it; returns (size, sha256)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return size, digest.hexdigest()


def fsync_dir(path: str) -> None:
    """Make the entries of a folder (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every folder under ``root`` (bottom-up), e.g. a staged folder before the rename that publishes it."""
    for folder, _subfolders, _files in os.walk(root, topdown=False):
        fsync_dir(folder)
