"""The application builder: ``serve run configs/serve.yaml`` (or ``serve run serve_app.app:build_app``) calls
:func:`build_app` with the typed :class:`AppArgs` from the config's ``args:``.

Seven component deployments, each a thin shell over a plain service, are composed with ``.bind()`` behind the
``Ingress``. Every deployment's constructor takes the args as a plain dict first (the one contract all
deployment modules follow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray.serve import Application

from alloy import components as c
from alloy.cluster.storage_rule import check_storage_for_cluster
from alloy.control.nodes import alive_ray_nodes
from deployments.artifact_store import ArtifactStoreDeployment
from deployments.dataset_registry import DatasetRegistryDeployment
from deployments.evaluation_engine import EvaluationEngine
from deployments.evolution_engine import EvolutionEngine
from deployments.experiment_tracker import ExperimentTrackerDeployment
from deployments.merge_engine import MergeEngineDeployment
from deployments.model_registry import ModelRegistryDeployment
from deployments.runtime import AppArgs
from serve_app.ingress import Ingress

__all__ = ["AppArgs", "build_app"]

GPU_ENGINES = c.ENGINES
GPU_AUTOSCALING = {
    "min_replicas": 0,
    "initial_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 10,
    "downscale_delay_s": 300,
}


def _check_cluster(args: AppArgs) -> None:
    """Refuse a multi-node cluster with node-local storage before anything is deployed."""

    if ray.is_initialized():
        check_storage_for_cluster(args.load_settings(), len(alive_ray_nodes()))


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _absolute(args: AppArgs) -> AppArgs:
    """Pin relative paths (config file, data dir) to the project root at build time, so that every replica,
    whatever its working directory, opens the same database and artifact folder."""
    config_path = args.config_path
    if config_path and not Path(config_path).is_absolute():
        config_path = str((PROJECT_ROOT / config_path).resolve())
    pinned = args.model_copy(update={"config_path": config_path})
    settings = pinned.load_settings()
    overrides = dict(pinned.settings)
    if not settings.data_dir.is_absolute():
        overrides["data_dir"] = str((PROJECT_ROOT / settings.data_dir).resolve())
    return pinned.model_copy(update={"settings": overrides})


def build_app(args: AppArgs) -> Application:
    if isinstance(args, dict):  # called from Python with a plain dict
        args = AppArgs.model_validate(args)
    args = _absolute(args)
    _check_cluster(args)
    settings = args.load_settings()
    payload = args.model_dump(mode="json")
    deployments: dict[str, Any] = {
        c.MODEL_REGISTRY: ModelRegistryDeployment,
        c.DATASET_REGISTRY: DatasetRegistryDeployment,
        c.MERGE_ENGINE: MergeEngineDeployment,
        c.EXPERIMENT_TRACKER: ExperimentTrackerDeployment,
        c.ARTIFACT_STORE: ArtifactStoreDeployment,
        c.EVALUATION_ENGINE: EvaluationEngine,
        c.EVOLUTION_ENGINE: EvolutionEngine,
    }
    if settings.profile == "gpu":
        for name in GPU_ENGINES:
            if name in deployments:
                deployments[name] = deployments[name].options(
                    ray_actor_options={"num_cpus": 1, "num_gpus": 1},
                    autoscaling_config=GPU_AUTOSCALING,
                )
    handles = {name: deployment.bind(payload) for name, deployment in deployments.items()}
    return Ingress.bind(payload, handles)  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment


def app_args_schema() -> dict[str, Any]:
    return AppArgs.model_json_schema()
