"""DatasetRegistry deployment: a thin shell over :class:`alloy.registry.datasets.DatasetRegistry`."""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments.runtime import open_services


@serve.deployment(name="DatasetRegistry", max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.1})
class DatasetRegistryDeployment:
    def __init__(self, args: dict[str, Any]):
        self.args, self.services = open_services(args)
        self.registry = self.services.datasets

    def register(
        self,
        dataset_id: str,
        source: str,
        splits: dict | None = None,
        task: dict | None = None,
        owner: str | None = None,
    ):
        kwargs: dict[str, Any] = {"splits": splits, "task": task}
        if owner is not None:
            kwargs["owner"] = owner
        return self.registry.register(dataset_id, source, **kwargs)

    def get(self, dataset_id: str):
        return self.registry.get(dataset_id)

    def list(self, offset: int = 0, limit: int = 50):
        return self.registry.list(offset=offset, limit=limit)

    def delete(self, dataset_id: str) -> None:
        self.registry.delete(dataset_id)

    def health(self) -> dict[str, Any]:
        self.registry.list(offset=0, limit=1)
        return {"status": "healthy"}
