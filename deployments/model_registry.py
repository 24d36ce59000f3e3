"""ModelRegistry deployment: a thin shell over :class:`alloy.registry.models.ModelRegistry`."""

from __future__ import annotations

import builtins  # the deployment's own list() method shadows the name below it
from typing import Any

from ray import serve

from alloy.registry.adapters import input_manifest
from deployments.runtime import open_services


@serve.deployment(name="ModelRegistry", max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1})
class ModelRegistryDeployment:
    def __init__(self, args: dict[str, Any]):
        self.args, self.services = open_services(args)
        self.registry = self.services.models

    def register(
        self, model_id: str, source: str, owner: str | None = None, lineage: dict | None = None, kind: str | None = None
    ):
        return self.registry.register(model_id, source, owner=owner, lineage=lineage, kind=kind)

    def get(self, model_id: str):
        return self.registry.get(model_id)

    def exists(self, model_id: str) -> bool:
        return self.registry.exists(model_id)

    def list(self, offset: int = 0, limit: int = 50):
        return self.registry.list(offset=offset, limit=limit)

    def delete(self, model_id: str) -> None:
        self.registry.delete(model_id)

    def manifests(self, model_ids: builtins.list[str]) -> dict[str, Any]:
        """Manifests of several merge inputs in one call (merge validation); an unknown id raises MODEL_NOT_FOUND,
        a ``base-id+adapter-id`` input is the base's manifest once the adapter fits it."""
        return {model_id: input_manifest(self.registry.manifest, model_id) for model_id in model_ids}

    def health(self) -> dict[str, Any]:
        self.registry.list(offset=0, limit=1)
        return {"status": "healthy"}
