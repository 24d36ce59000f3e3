"""The warm-start pool snapshot written back into the real Serve config (configs/serve.yaml), no Ray needed."""

from __future__ import annotations

from pathlib import Path

from alloy.control.serve_deploy import load_serve_config
from alloy.control.serve_ops import apply_pool_snapshot

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "serve.yaml"


def deployments(config) -> dict:
    return {d.name: d for d in config.applications[0].deployments}


def test_snapshot_sets_initial_replicas_within_autoscaling_bounds():
    config = load_serve_config(SERVE_CONFIG)
    restored = deployments(apply_pool_snapshot(config, {"MergeEngine": 2, "EvaluationEngine": 5, "Ingress": 0}))
    merge = restored["MergeEngine"].autoscaling_config
    evaluation = restored["EvaluationEngine"].autoscaling_config
    merge = merge if isinstance(merge, dict) else merge.model_dump()
    evaluation = evaluation if isinstance(evaluation, dict) else evaluation.model_dump()
    assert merge["initial_replicas"] == 2
    assert evaluation["initial_replicas"] == evaluation["max_replicas"]  # clamped
    assert restored["Ingress"].num_replicas == 1  # a fixed deployment never restores to zero
    # the original config is left as it was
    original = deployments(config)["MergeEngine"].autoscaling_config
    original = original if isinstance(original, dict) else original.model_dump()
    assert original.get("initial_replicas") in (None, 1) and original != merge


def test_an_empty_snapshot_changes_nothing():
    config = load_serve_config(SERVE_CONFIG)
    assert apply_pool_snapshot(config, {}) is config
