"""configs/serve.multinode.yaml: Ray's own schema accepts it, the proxy-side deployments are pinned to the head
and the engines to worker nodes (the custom resource the multi-node harness and cluster.yaml give workers), and
the head's share fits the harness's one logical head CPU with no room for a 0.5-CPU trial."""

from __future__ import annotations

from pathlib import Path

from alloy import components as c
from alloy.control.nodes import HEAD_RESOURCE
from alloy.control.serve_deploy import load_serve_config
from tests.fixtures.multinode import HEAD_CPUS, WORKER_RESOURCES

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "serve.multinode.yaml"


def test_the_engines_run_on_workers_and_the_rest_on_the_head():
    app = load_serve_config(CONFIG).applications[0]
    deployments = {d.name: d.model_dump(exclude_unset=True) for d in app.deployments}
    head_cpus = 0.0
    for name, spec in deployments.items():
        resources = spec["ray_actor_options"]["resources"]
        if name in c.ENGINES:
            assert set(resources) <= set(WORKER_RESOURCES) and resources, name
        else:
            assert set(resources) == {HEAD_RESOURCE}, name
            head_cpus += spec["ray_actor_options"]["num_cpus"] * spec.get("num_replicas", 1)
    assert set(c.ENGINES) <= set(deployments)
    assert HEAD_CPUS - head_cpus < 0.5  # evolution trials (0.5 CPU each) never land on the head
    assert deployments[c.MERGE_ENGINE]["autoscaling_config"]["min_replicas"] >= 2  # one per worker
