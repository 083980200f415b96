"""The Grafana dashboard shipped in the package: valid JSON whose every PromQL expression
names only metrics `servelm serve` exports, with the live dashboard's panels."""

from __future__ import annotations

import json
import re

import pytest

from servelm.server.dashboard import asset
from servelm.server.metrics import ServerMetrics

_NAME = re.compile(r"\bservelm_[a-z0-9_]+\b")


def exported_names() -> set[str]:
    registry = ServerMetrics("m", 1.0, 0.1).registry
    return {s.name for metric in registry.collect() for s in metric.samples}


def unknown_metrics(exprs: list[str], names: set[str]) -> list[str]:
    return [m for e in exprs for m in _NAME.findall(e) if m not in names]


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_expr_names_an_exported_metric():
    dash = json.loads(asset("grafana.json"))
    exprs = _exprs(dash)
    assert len(exprs) >= 20
    names = exported_names()
    assert "servelm_time_to_first_token_seconds_bucket" in names  # the checker sees samples
    assert unknown_metrics(exprs, names) == []
    for e in exprs:
        assert e.count("(") == e.count(")"), e
        assert _NAME.search(e), e


def test_checker_catches_a_wrong_name():
    names = exported_names()
    assert unknown_metrics(["rate(servelm_time_to_first_token_second_bucket[5m])"], names) == \
        ["servelm_time_to_first_token_second_bucket"]


@pytest.mark.parametrize("metric", [
    "servelm_num_requests_running", "servelm_num_requests_waiting", "servelm_kv_cache_usage_ratio",
    "servelm_prefix_cache_hit_tokens_total", "servelm_time_to_first_token_seconds_bucket",
    "servelm_time_per_output_token_seconds_bucket", "servelm_e2e_request_latency_seconds_bucket",
    "servelm_requests_slo_met_total", "servelm_generation_tokens_total",
    "servelm_step_bandwidth_utilization_bucket", "servelm_step_compute_utilization_bucket",
    "servelm_preemptions_total", "servelm_spec_accepted_tokens_total",
    "servelm_request_queue_time_seconds_bucket"])
def test_the_live_dashboards_panels_are_there(metric):
    dash = json.loads(asset("grafana.json"))
    assert any(metric in e for e in _exprs(dash))
