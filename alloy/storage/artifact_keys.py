"""The artifact store's names: keys (relative POSIX paths, confined), the reserved names, what one stored object
is (:class:`ArtifactInfo`) and the error of a stored file whose bytes no longer match their sha256."""

from __future__ import annotations

from pydantic import BaseModel

from alloy.errors import AlloyError, ErrorCode, validation_failed

STAGING = ".staging"
DIR_MANIFEST = ".alloy-dir.json"
PENDING_MARKER = ".alloy-pending"
RESERVED_NAMES = frozenset({STAGING, DIR_MANIFEST, PENDING_MARKER})
MAX_KEY_LENGTH = 1024
STAGING_TAG_SEPARATOR = "~"  # "/" of a staged prefix in a staging folder's name (never part of an id)


class CorruptArtifact(AlloyError):
    """A downloaded file does not match the sha256 its folder manifest recorded."""

    def __init__(self, key: str):
        super().__init__(ErrorCode.VALIDATION_FAILED, f"artifact {key!r} is corrupt (sha256 mismatch)", {"key": key})
        self.key = key

    def __reduce__(self):
        return (CorruptArtifact, (self.key,))


class ArtifactInfo(BaseModel):
    key: str
    uri: str
    size: int
    sha256: str | None = None  # known for everything this store wrote; None for foreign objects


def check_key(key: str, *, allow_root: bool = False) -> str:
    """A relative, normalised POSIX key: no absolute paths, no ``..``, no reserved names."""
    if not isinstance(key, str):
        raise validation_failed("artifact key must be a string")
    if allow_root:  # a prefix: "" is the whole store, a trailing "/" is tolerated
        key = key.rstrip("/")
        if key == "":
            return ""
    parts = key.split("/")
    if (
        not key
        or len(key) > MAX_KEY_LENGTH
        or key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or any(part in ("", ".", "..") or part in RESERVED_NAMES for part in parts)
    ):
        raise validation_failed("invalid artifact key: relative POSIX path without '..' or reserved names", key=key)
    return key


def staging_tag(prefix: str) -> str:
    """The name part of a staging folder that publishes ``prefix``."""
    return prefix.replace("/", STAGING_TAG_SEPARATOR)
