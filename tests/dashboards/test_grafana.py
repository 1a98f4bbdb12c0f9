"""The Grafana dashboards and provisioning: valid, and every metric a panel queries exists.

Collector metrics are read from a running collector's /metrics; trainer metrics from the
trainer's own exposition (trainer/metrics.py) after one step and one sync, and from the fixed
list the trainer promises.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
import yaml

from lightspan.collector.server import Collector
from tests.collector.helpers import config
from tests.dashboards.prometheus import parse_prometheus

GRAFANA = Path(__file__).resolve().parents[2] / "dashboards" / "grafana"
METRIC = re.compile(r"\blightspan_[a-z0-9_]+")
TRAINER_METRICS = {   # the names the trainer serves on :9464 (fixed by the dashboards' contract)
    "gauge": ["step", "policy_version", "reward_mean", "advantage_std", "loss", "kl", "clip_ratio", "entropy",
              "is_ratio_mean", "tokens_per_second", "staleness_mean"],
    "counter": ["transitions_trained_total", "transitions_skipped_stale_total", "sync_failures_total"],
    "histogram": ["sync_seconds"],
}


def dashboard(name: str) -> dict:
    return json.loads((GRAFANA / f"{name}.json").read_text())


def exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def sample_names(text: str) -> set[str]:
    return set(parse_prometheus(text))


@pytest.fixture(scope="module")
def collector_metrics(tmp_path_factory) -> set[str]:
    collector = Collector(config(tmp_path_factory.mktemp("grafana-data"))).start()
    try:
        return sample_names(requests.get(f"http://127.0.0.1:{collector.api_port}/metrics", timeout=10).text)
    finally:
        collector.stop()


def trainer_metrics() -> set[str]:
    fixed = {f"lightspan_trainer_{n}" for n in TRAINER_METRICS["gauge"] + TRAINER_METRICS["counter"]}
    fixed |= {f"lightspan_trainer_{n}_{s}" for n in TRAINER_METRICS["histogram"] for s in ("bucket", "sum", "count")}
    try:
        from lightspan.trainer.metrics import GAUGES, TrainerMetrics
    except ImportError:
        return fixed
    metrics = TrainerMetrics()
    metrics.observe_step({key: 1.0 for _, key in GAUGES.values()} | {"num_transitions": 1, "skipped_stale": 0})
    metrics.observe_sync(0.1)
    served = sample_names(metrics.render())
    assert fixed <= served, f"the trainer does not serve {sorted(fixed - served)}"
    return served


@pytest.mark.parametrize("name", ["lightspan-collector", "lightspan-trainer"])
def test_dashboard_is_well_formed(name):
    doc = dashboard(name)
    assert doc["uid"] == name and doc["title"] and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}
        assert panel["description"], f"panel {panel['title']!r} explains nothing"
        assert panel["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"])
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24


def test_every_collector_panel_queries_a_metric_the_collector_serves(collector_metrics):
    queried = {m for e in exprs(dashboard("lightspan-collector")) for m in METRIC.findall(e)}
    assert queried and queried <= collector_metrics, sorted(queried - collector_metrics)


def test_every_trainer_panel_queries_a_metric_the_trainer_serves():
    served = trainer_metrics()
    queried = {m for e in exprs(dashboard("lightspan-trainer")) for m in METRIC.findall(e)}
    assert queried and queried <= served, sorted(queried - served)
    fixed = {f"lightspan_trainer_{n}" for kind in ("gauge", "counter") for n in TRAINER_METRICS[kind]}
    assert fixed <= queried, f"not on the dashboard: {sorted(fixed - queried)}"
    assert "lightspan_trainer_sync_seconds_bucket" in queried


def test_metric_glossary_explains_every_metric_the_dashboards_show(collector_metrics):
    glossary = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    shown = {m for name in ("lightspan-collector", "lightspan-trainer") for e in exprs(dashboard(name))
             for m in METRIC.findall(e)}
    base = {re.sub(r"_(bucket|sum|count)$", "", m) for m in shown}
    missing = sorted(m for m in base if f"`{m}`" not in glossary)
    assert not missing, f"docs/metrics.md does not explain {missing}"


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    [source] = datasources["datasources"]
    assert (source["type"], source["uid"], source["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "lightspan.yaml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
