"""--api-key on every route but /health (no path spelling gets around it), and /metrics."""

from __future__ import annotations

import socket

import openai
import pytest

from live_server import MODEL, LiveServer, parse_metrics

KEY = "sk-servelm-test"


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, api_key=KEY)
    yield s
    s.stop()


def raw_get(port: int, target: str, headers: str = "") -> int:
    """Status of a GET whose request target is sent byte for byte (no client normalising)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n"
                     .encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/" + MODEL), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/version"),
          ("GET", "/no/such/route")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_but_health_needs_the_key(server, method, path):
    import httpx

    with httpx.Client(base_url=server.url) as c:
        r = c.request(method, path, json={"prompt": "Hi"} if method == "POST" else None)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        wrong = c.request(method, path, headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        basic = c.request(method, path, headers={"Authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("target", [
    "//v1/models", "/v1/models/", "/V1/models", "/health/../v1/models", "/health/..%2Fv1/models",
    "/%76%31/models", "/v1/%6dodels", "/v1/models%2F", "/./v1/models", "/health/", "/HEALTH",
    "/health%00", "/v1//models", "/metrics?x=/health", "http://127.0.0.1/v1/models",
])
def test_path_tricks_do_not_bypass_the_key(server, target):
    assert raw_get(server.port, target) == 401
    assert raw_get(server.port, target, f"Authorization: Bearer {KEY}\r\n") != 401


def test_openai_client_with_the_key(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_after_traffic(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=4, extra_body={"ignore_eos": True})
    m = server.wait_idle()
    with server.client() as c:
        text = c.get("/metrics").text
    for name in ["time_to_first_token_seconds", "time_per_output_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "step_time_seconds", "step_batch_size", "step_tokens",
                 "step_bandwidth_utilization", "step_compute_utilization"]:
        assert f"# TYPE servelm_{name} histogram" in text
        assert m[f"servelm_{name}_count"] > 0, name
    assert m["servelm_time_to_first_token_seconds_count"] >= 4
    assert 0 < m["servelm_time_to_first_token_seconds_sum"] < 60 * 4
    assert m['servelm_requests_finished_total{finish_reason="length"}'] >= 4
    assert m["servelm_generation_tokens_total"] >= 3 * 5 + 4
    assert m["servelm_prompt_tokens_total"] > 0
    assert m["servelm_preemptions_total"] >= 0
    assert m["servelm_kv_blocks_total"] > 0
    assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
    assert m["servelm_kv_cache_usage_ratio"] == 0
    assert m["servelm_num_requests_running"] == 0 and m["servelm_num_requests_waiting"] == 0
    assert 0 <= m["servelm_prefix_cache_hit_rate"] <= 1
    assert 0 < m["servelm_bandwidth_utilization"] < 10
    assert 0 < m["servelm_compute_utilization"] < 10
    assert m["servelm_step_bytes_total"] > 0 and m["servelm_step_flops_total"] > 0
    assert m["servelm_requests_slo_judged_total"] >= 4
    assert 0 <= m["servelm_goodput_ratio"] <= 1
    assert m["servelm_requests_slo_met_total"] <= m["servelm_requests_slo_judged_total"]
    assert m["servelm_engine_alive"] == 1
    assert m['servelm_http_responses_total{code="200"}'] >= 4


def test_parse_metrics_reads_labels():
    assert parse_metrics('a_total{x="1"} 2.0\nb 3\n# HELP c d') == {'a_total{x="1"}': 2.0,
                                                                   "b": 3.0}
