"""/dashboard/data on a live model-free server: guarded by the API key, its numbers the
same as /metrics, the waterfall adding up to each request's latency, bad input refused with
the parameter named."""

from __future__ import annotations

import httpx
import pytest
from servers import fake_server, metrics

from servelm.cli import main as servelm_main

KEY = "k-data"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = fake_server(api_key=KEY, per_token_s=1e-5, slo_ttft_ms=500, slo_tpot_ms=50)
    yield s
    s.stop()


def test_data_is_guarded_and_matches_metrics(server):
    assert httpx.get(server.url + "/dashboard/data").status_code == 401
    assert httpx.get(server.url + "/dashboard").status_code == 200  # the page holds no data
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        for i in range(5):
            r = c.post("/v1/completions", json={"model": "fake", "prompt": [3 + i] * 30,
                                                "max_tokens": 4 + i, "ignore_eos": True,
                                                "stream": i % 2 == 1})
            assert r.status_code == 200
        d = c.get("/dashboard/data", params={"records": 1}).json()
    m = metrics(server.url, AUTH)
    assert d["counters"]["generation_tokens"] == m["servelm_generation_tokens_total"] == 30
    assert d["counters"]["prompt_tokens"] == m["servelm_prompt_tokens_total"] == 150
    assert d["gauges"]["goodput"] == m["servelm_goodput_ratio"]
    assert d["window"]["ttft_s"]["count"] == m["servelm_time_to_first_token_seconds_count"] == 5
    assert d["window"]["num_requests"] == 5 and len(d["records"]) == 5
    for row in d["slowest"]:
        assert sum(row["phases"].values()) == pytest.approx(row["latency_s"], abs=2e-3)
    streamed = [r for r in d["records"] if r["stream"]]
    assert len(streamed) == 2 and all(r["delivery_lag_s"] is not None for r in streamed)
    assert all(r["host_s"] is not None and r["queue_s"] is not None for r in d["records"])


@pytest.mark.parametrize("window", ["abc", "0", "99999"])
def test_bad_window_names_the_parameter(server, window):
    r = httpx.get(server.url + "/dashboard/data", params={"window": window}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "window"


def test_doctor_with_a_wrong_key_says_so(server, capsys):
    assert servelm_main(["doctor", "--url", server.url, "--api-key", "nope"]) == 2
    assert "--api-key" in capsys.readouterr().err
