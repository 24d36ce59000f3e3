"""Serve config files against Ray's own schema, the CPU profile's budget, the GPU profile, the multi-node storage
rule and GPU_UNAVAILABLE."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alloy.cluster.storage_rule import check_storage_for_cluster
from alloy.config import Settings
from alloy.control.serve_deploy import load_serve_config
from alloy.errors import AlloyError, ErrorCode
from deployments.runtime import AppArgs

ROOT = Path(__file__).resolve().parents[2]
ENGINES_WITH_GPU = {"MergeEngine", "EvaluationEngine", "EvolutionEngine"}


def deployments_of(name: str) -> dict[str, dict]:
    config = load_serve_config(ROOT / "configs" / name)  # ServeDeploySchema: raises if invalid
    app = config.applications[0]
    assert app.import_path == "serve_app.app:build_app"
    AppArgs.model_validate(app.args)  # the builder's typed args accept the file's args
    return {d.name: d.model_dump(exclude_unset=True) for d in app.deployments}


def test_cpu_profile_fits_two_cores():
    deployments = deployments_of("serve.yaml")
    total = 0.0
    for spec in deployments.values():
        replicas = spec.get("autoscaling_config", {}).get("max_replicas") or spec.get("num_replicas", 1)
        total += spec["ray_actor_options"]["num_cpus"] * replicas
        assert not spec["ray_actor_options"].get("num_gpus")
    assert total <= 2.0
    merge = deployments["MergeEngine"]
    assert merge["graceful_shutdown_timeout_s"] == 300
    assert merge["autoscaling_config"]["target_ongoing_requests"] == 1


def test_gpu_profile_autoscales_engines_with_one_gpu_each():
    deployments = deployments_of("serve.gpu.yaml")
    engines = ENGINES_WITH_GPU & set(deployments)
    assert {"MergeEngine", "EvaluationEngine"} <= engines
    for name in engines:
        spec = deployments[name]
        assert spec["ray_actor_options"]["num_gpus"] == 1
        assert spec["autoscaling_config"]["max_replicas"] > spec["autoscaling_config"]["min_replicas"]
        assert spec["graceful_shutdown_timeout_s"] >= 300
    raw = yaml.safe_load((ROOT / "configs" / "serve.gpu.yaml").read_text())
    assert raw["applications"][0]["args"]["profile"] == "gpu"


def test_embedded_default_config_is_valid_settings(monkeypatch):
    monkeypatch.setenv("ALLOY_CONFIG", str(ROOT / "configs" / "alloy.yaml"))
    settings = Settings()
    assert settings.database_url.startswith("sqlite") and "://" not in settings.artifacts_uri


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ({}, True),
        ({"database": {"url": "postgresql+psycopg://db/alloy"}}, True),
        ({"artifacts": {"uri": "s3://bucket/alloy"}}, True),
        ({"database": {"url": "postgresql+psycopg://db/alloy"}, "artifacts": {"uri": "s3://bucket/alloy"}}, False),
    ],
)
def test_multi_node_cluster_refuses_node_local_storage(tmp_path, overrides, refused):
    settings = Settings(data_dir=tmp_path, **overrides)
    check_storage_for_cluster(settings, alive_nodes=1)  # one node: anything goes
    if refused:
        with pytest.raises(AlloyError) as caught:
            check_storage_for_cluster(settings, alive_nodes=3)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        assert "3 nodes" in caught.value.message
    else:
        check_storage_for_cluster(settings, alive_nodes=3)


@pytest.mark.ray
def test_gpu_profile_without_gpus_answers_gpu_unavailable(ray_cluster, tmp_path):
    """The real cluster has no GPU: job creation under the GPU profile is refused with 503 GPU_UNAVAILABLE
    before anything is validated or created."""
    from fastapi.testclient import TestClient

    from alloy.config import ConfigHolder
    from alloy.control.nodes import cluster_gpu_count as _cluster_gpus
    from alloy.storage.db import Database
    from alloy.storage.keys import ApiKeyStore
    from deployments.runtime import Services
    from serve_app.api import create_api
    from serve_app.context import ApiContext

    settings = Settings(data_dir=tmp_path, profile="gpu")
    Database.from_settings(settings).upgrade()
    services = Services(settings)
    _, key = ApiKeyStore(services.db).create("gpu-test", ["write"])
    context = ApiContext(config=ConfigHolder(settings), services=services, profile="gpu", gpu_probe=_cluster_gpus)
    with TestClient(create_api(context)) as client:
        response = client.post(
            "/merge/execute",
            headers={"Authorization": f"Bearer {key}"},
            json={"models": ["a", "b"], "strategy": "ties", "output_model_id": "c"},
        )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "GPU_UNAVAILABLE"

    on_demand = ApiContext(
        config=ConfigHolder(settings), services=None, profile="gpu", gpu_on_demand=True, gpu_probe=_cluster_gpus
    )
    on_demand.require_gpu_capacity()  # an autoscaling cluster may add a GPU node: accepted


def test_reload_keeps_the_builders_overrides(tmp_path):
    from alloy.config import ConfigHolder

    args = AppArgs(settings={"data_dir": str(tmp_path), "server": {"public_url": "https://alloy.example"}})
    holder = ConfigHolder(args.load_settings(), loader=args.load_settings)
    assert holder.reload() == 2
    assert holder.settings.data_dir == tmp_path
    assert holder.settings.server.public_url == "https://alloy.example"
