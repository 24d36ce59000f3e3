"""configs/grafana/alloy-dashboard.json charts only metrics the service exports, through one data source variable."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serve_app.metrics import ApiMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "alloy-dashboard.json"
METRIC = re.compile(r"\balloy_[a-z_]+")


def _exported_names() -> set[str]:
    names = set()
    for family in ApiMetrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_every_expression_uses_exported_metrics_and_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported_names()
    used = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            used.update(METRIC.findall(target["expr"]))
    assert used and used <= exported, used - exported
    assert {"alloy_cluster_state", "alloy_http_requests_total", "alloy_merge_bytes_per_second"} <= used
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
