"""The HTTP ingress deployment: builds the FastAPI app of :mod:`serve_app.api` inside its replica, with the
component deployments' handles.

The app is built late (``__serve_build_asgi_app__``, after the constructor) because it needs this replica's
settings and database connection; nothing of it is pickled from the process that built the application.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from alloy import components as c
from alloy.cluster.state import CachedClusterState, ClusterStateStore
from alloy.cluster.storage_rule import check_storage_for_cluster
from alloy.config import ConfigHolder
from alloy.control.nodes import alive_ray_nodes, cluster_gpu_count
from deployments.runtime import open_services
from serve_app.api import create_api
from serve_app.context import ApiContext


@serve.deployment(name=c.INGRESS, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class Ingress:
    def __init__(self, args: dict[str, Any], handles: dict[str, Any]):
        self.args, self.services = open_services(args)
        check_storage_for_cluster(self.services.settings, len(alive_ray_nodes()))
        self.services.db  # noqa: B018 - open and verify the schema now, not on the first request
        self.context = ApiContext(
            config=ConfigHolder(self.services.settings, loader=self.args.load_settings),
            services=self.services,
            handles={name: h for name, h in handles.items() if h is not None},
            public_url=self.args.public_url,
            profile=self.services.settings.profile,
            gpu_on_demand=self.args.gpu_on_demand,
            gpu_probe=cluster_gpu_count,
            cluster_gate=CachedClusterState(ClusterStateStore(self.services.db), ttl_s=1.0),
        )

    def __serve_build_asgi_app__(self):
        return create_api(self.context, behind_serve_proxy=True)
