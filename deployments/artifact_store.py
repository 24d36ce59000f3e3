"""ArtifactStore deployment: a thin shell over :class:`alloy.storage.artifacts.ArtifactStore`; downloads are streamed
through the handle in chunks so no artifact is ever held whole in the ingress."""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments.runtime import open_services


@serve.deployment(name="ArtifactStore", max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1})
class ArtifactStoreDeployment:
    def __init__(self, args: dict[str, Any]):
        self.args, self.services = open_services(args)
        self.store = self.services.store

    def info(self, key: str):
        return self.store.info(key)

    def list(self, prefix: str = ""):
        return self.store.list(prefix)

    def iter_bytes(self, key: str, start: int = 0):
        """Generator method: call with ``handle.options(stream=True)``. ``start``: resume a download (HTTP Range)."""
        if not start:
            yield from self.store.iter_bytes(key)
            return
        with self.store.open(key) as handle:
            handle.seek(start)
            while chunk := handle.read(self.store.chunk_bytes):
                yield chunk

    def health(self) -> dict[str, Any]:
        self.store.exists("__health__")
        return {"status": "healthy"}
