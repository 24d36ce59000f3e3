"""cluster.yaml is a valid Ray cluster-launcher file by Ray's own schema and installs this project."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_cluster_yaml_validates_against_rays_schema(cluster, ray_schema):
    jsonschema.validate(cluster, ray_schema)
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))  # what `ray up` does: defaults filled, then checked


def test_the_schema_check_is_not_vacuous(cluster, ray_schema):
    broken = copy.deepcopy(cluster)
    broken["available_node_types"]["gpu_worker"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, ray_schema)


def test_head_plus_autoscaling_gpu_workers_that_install_the_project(cluster):
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    gpu = types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1 and gpu["max_workers"] > gpu["min_workers"]
    assert any("pip install" in command and "-e ." in command for command in cluster["setup_commands"])
    assert cluster["file_mounts"]["~/alloy"] == "."
