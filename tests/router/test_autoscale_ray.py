"""`servelm serve --backend ray --autoscale POLICY`: the default model's replicas as Ray
actors on a 3-CPU local Ray cluster the test starts itself (1 CPU, --threads 1 a replica),
a load ramp up and down through the router; scale events counted on /metrics, every request
answered, at most 3 replicas."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from live_server import MODEL
from serve_process import ServeProcess

from replica_reference import edited, parse, received
from servelm.router.ray_backend import replica_serve_options

pytest.importorskip("ray")

RAY_NUM_CPUS = 3  # the ray_cluster fixture (conftest.py): up to 3 replicas of 1 CPU


def test_a_replica_does_not_get_the_autoscale_option(monkeypatch):
    argv = ["m", "--backend", "ray", "--autoscale", "p.json", "--max-model-len", "64"]
    assert received(replica_serve_options(parse(argv), 1.0), monkeypatch) == \
        edited(["m", "--max-model-len", "64", "--threads", "1"])


def test_bad_policy_file_is_refused_before_anything_starts(tmp_path):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"target": 100, "max_replicas": 0}))
    r = subprocess.run([sys.executable, "-m", "servelm.cli", "serve", MODEL, "--backend",
                        "ray", "--autoscale", str(policy), "--port", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "max_replicas" in r.stderr
    policy.write_text(json.dumps({"target": 1, "signal": "utilization"}))
    r = subprocess.run([sys.executable, "-m", "servelm.cli", "serve", MODEL, "--backend",
                        "ray", "--autoscale", str(policy), "--port", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "signal" in r.stderr


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait(srv: ServeProcess, cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    m: dict = {}
    while True:
        try:
            m = _metrics(srv.url)
        except httpx.HTTPError:  # the router is not listening yet
            pass
        else:
            if cond(m):
                return m
        assert srv.proc.poll() is None, "".join(srv.stderr[-40:])
        assert time.monotonic() < deadline, f"{what}: {m}\n" + "".join(srv.stderr[-40:])
        time.sleep(0.5)


@pytest.mark.slow
def test_load_ramp_scales_up_to_three_and_back_without_losing_a_request(
        default_model_path, ray_cluster, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({
        # Six users x ~56 tokens: 1.7x the target on two replicas (so a first scale-up that
        # stopped at two, the smallest count wanted over its window, goes on to three), and
        # inside the dead band on three.
        "target": 100, "min_replicas": 1, "max_replicas": 3, "scale_up_threshold": 1.2,
        "scale_down_threshold": 0.5, "up_window_s": 2, "down_cooldown_s": 8, "tick_s": 1,
        "boot_s": 20, "drain_timeout_s": 60}))
    srv = ServeProcess("--backend", "ray", "--ray-address", ray_cluster, "--replica-cpus",
                       "1", "--threads", "1", "--autoscale", str(policy),
                       "--router-policy", "least_loaded", "--max-model-len", "512",
                       "--no-log-requests")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    results: list[int] = []
    errors: list[BaseException] = []
    stops = [threading.Event() for _ in range(6)]

    def user(i: int):
        k = 0
        while not stops[i].is_set():
            try:
                out = client.completions.create(model=MODEL, prompt=f"User {i} asks {k}:",
                                                max_tokens=48, temperature=0,
                                                extra_body={"ignore_eos": True})
                results.append(out.usage.completion_tokens)
            except BaseException as exc:  # noqa: BLE001 - any failure fails the test
                errors.append(exc)
            k += 1

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(6)]
    try:
        m = _wait(srv, lambda m: m["servelm_router_replicas_serving"] == 1, 120, "start")
        assert "autoscaled 1..3 on tokens_in_flight" in "".join(srv.stderr)
        # Ramp up: one user, then six; the fleet grows to three.
        threads[0].start()
        time.sleep(3)
        for t in threads[1:]:
            t.start()
        m = _wait(srv, lambda m: m["servelm_router_replicas_serving"] == 3, 150, "scale up")
        ups = m['servelm_router_autoscale_events_total{direction="up"}']
        assert 1 <= ups <= 2
        assert m["servelm_router_tokens_in_flight"] > 0
        num_at_peak = len(results)
        time.sleep(5)
        assert len(results) > num_at_peak  # served by three
        # Ramp down: one user keeps sending while replicas drain and go, then none.
        for e in stops[1:]:
            e.set()
        for t in threads[1:]:
            t.join(300)
        m = _wait(srv, lambda m: m["servelm_router_replicas_serving"] == 1
                  and m["servelm_router_replicas_draining"] == 0, 150, "scale down")
        stops[0].set()
        threads[0].join(300)
        assert m['servelm_router_autoscale_events_total{direction="down"}'] >= 1
        assert m["servelm_router_replicas_booting"] == 0
        assert m['servelm_router_autoscale_events_total{direction="up"}'] == ups  # no flap
    finally:
        for e in stops:
            e.set()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(120)
    assert errors == [], errors[:3]
    assert results and all(n == 48 for n in results)
    assert code == 0, "".join(srv.stderr[-30:])
    log = "".join(srv.stderr)
    assert log.count("router: added") == 2 and log.count("router: removed") == 2
