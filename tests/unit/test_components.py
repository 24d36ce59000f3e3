"""The component names of alloy.components are the ones the Serve configs and the deployments use."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alloy import components as c

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("serve*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_configs_name_exactly_the_components(path):
    application = yaml.safe_load(path.read_text())["applications"][0]
    assert application["name"] == c.APP_NAME
    assert {d["name"] for d in application["deployments"]} == {*c.BACKENDS, c.INGRESS}


def test_every_job_kind_has_an_engine():
    from alloy.jobs.records import JobKind

    assert {c.ENGINE_OF_KIND[kind.value] for kind in JobKind} == set(c.ENGINES)


def test_the_deployments_are_named_after_their_components():
    from deployments.evaluation_engine import EvaluationEngine
    from deployments.evolution_engine import EvolutionEngine
    from deployments.merge_engine import MergeEngineDeployment
    from serve_app.app import build_app  # noqa: F401 - imports every deployment module

    for deployment in (MergeEngineDeployment, EvaluationEngine, EvolutionEngine):
        assert deployment.name == deployment.func_or_class.COMPONENT
    assert {d.name for d in (MergeEngineDeployment, EvaluationEngine, EvolutionEngine)} == set(c.ENGINES)
