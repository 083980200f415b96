"""The SLO spec through the server: a request names its class with `priority` or
`slo_class` (a bad one is a 400 naming the field), its engine request carries that class's
targets, the per-class goodput gauges count it over the spec's window, and the SLO policy's
early refusal is a 429 with Retry-After."""

from __future__ import annotations

import json

import pytest

from live_server import LiveServer
from servelm.engine.slo_policy import SLOUnattainableError
from servelm.server.errors import APIError

SPEC = {"classes": [
    {"name": "interactive", "priority": 0, "ttft_ms": 60000, "tpot_ms": 60000},
    {"name": "batch", "priority": 1, "ttft_ms": 0.001, "tpot_ms": 0.001}],
    "default_class": "interactive", "window_s": 600}


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("slo") / "slo.json"
    path.write_text(json.dumps(SPEC))
    s = LiveServer(engine, slo_spec=str(path))
    yield s
    s.stop()


def _post(server, **extra):
    with server.client() as c:
        return c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3,
                                               "ignore_eos": True, **extra})


def test_requests_are_counted_in_the_class_they_name(server):
    assert _post(server).status_code == 200  # the default class
    assert _post(server, slo_class="interactive").status_code == 200
    assert _post(server, priority=1).status_code == 200  # batch, by priority
    assert _post(server, slo_class="batch", priority=1).status_code == 200
    # n choices are one request: judged once, when its last choice finishes
    assert _post(server, slo_class="batch", n=2).status_code == 200
    m = server.wait_idle()
    assert m['servelm_slo_window_requests{slo_class="interactive"}'] == 2
    assert m['servelm_slo_window_requests{slo_class="batch"}'] == 3
    assert not server.state.metrics.request_classes  # nothing left behind
    # interactive's targets are a minute: met; batch's a microsecond: missed
    assert m['servelm_slo_goodput_ratio{slo_class="interactive"}'] == 1.0
    assert m['servelm_slo_goodput_ratio{slo_class="batch"}'] == 0.0


@pytest.mark.parametrize("extra, param", [({"slo_class": "gold"}, "slo_class"),
                                          ({"priority": 5}, "priority"),
                                          ({"priority": 0, "slo_class": "batch"}, "priority"),
                                          ({"priority": "high"}, "priority")])
def test_a_bad_class_is_a_400_naming_the_field(server, extra, param):
    r = _post(server, **extra)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_the_early_refusal_is_a_429_with_retry_after():
    err = APIError.from_invalid(SLOUnattainableError("slo_class 'x' cannot meet its TTFT"))
    assert err.status == 429 and err.code == "slo_unattainable" and err.param == "slo_class"
    resp = err.response()
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"


def test_a_bad_spec_stops_serve_before_the_model_loads(tmp_path, capsys):
    from servelm.cli import main

    bad = tmp_path / "slo.json"
    bad.write_text(json.dumps({"classes": [{"name": "a", "ttft_ms": 1}]}))
    assert main(["serve", "no-such-model", "--port", "0", "--slo-spec", str(bad)]) == 2
    assert "classes[0].tpot_ms: required" in capsys.readouterr().err


def test_a_request_refused_at_admission_leaves_no_class_behind(server):
    """The engine refuses it (max_tokens past the context) after the class was attached:
    no delta ever comes, so the server drops the entry itself."""
    r = _post(server, slo_class="batch", max_tokens=10**7)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not server.state.metrics.request_classes
