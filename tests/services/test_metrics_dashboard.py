"""The Grafana dashboard parses and queries only metrics the services define."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "baton-dashboard.json"
METRICS = Path(__file__).resolve().parents[2] / "services" / "metrics.py"


def test_dashboard_queries_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    defined = set(re.findall(r'"(baton_[a-z_]+)"', METRICS.read_text()))
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(name.removesuffix("_bucket") for name in re.findall(r"ray_(baton_[a-z_]+)", target["expr"]))
    assert used and used <= defined, used - defined
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
