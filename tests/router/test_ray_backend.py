"""`servelm serve --backend ray`: replicas as Ray actors on a local Ray cluster that the test
starts itself (`ray start --head` on 127.0.0.1), the router in front."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from live_server import MODEL
from serve_process import ServeProcess
from replica_reference import edited, parse, received
from servelm.router.ray_backend import replica_serve_options

pytest.importorskip("ray")



def test_a_replica_gets_the_drivers_options_but_not_its_own(monkeypatch):
    argv = ["m", "--backend", "ray", "--num-replicas=3", "--ray-address", "h:1", "--port",
            "9", "--replica-cpus", "2", "--router-policy", "session", "--max-model-len", "64"]
    assert received(replica_serve_options(parse(argv), 2.0), monkeypatch) == \
        edited(["m", "--max-model-len", "64", "--threads", "2"])
    assert received(replica_serve_options(parse(["m", "--threads", "1"]), 4.0),
                    monkeypatch) == edited(["m", "--threads", "1"])


def _wait_healthy(srv: ServeProcess, n: int, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            health = httpx.get(srv.url + "/health").json()
            if health.get("healthy_replicas") == n:
                return health
        except (httpx.HTTPError, ValueError):
            pass
        assert srv.proc.poll() is None and time.monotonic() < deadline, "".join(srv.stderr)
        time.sleep(0.3)


def _routed(srv: ServeProcess) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("servelm_router_requests_total{")}


def test_two_replicas_as_ray_actors(default_model_path, ray_cluster, monkeypatch):
    # The driver (servelm serve) prints the actors' logs; Ray folds lines that differ only
    # in numbers and come within seconds of each other ("[repeated 2x across cluster]"),
    # which two replicas starting together do: keep every line, the test reads the pids.
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    srv = ServeProcess("--backend", "ray", "--num-replicas", "2", "--ray-address", ray_cluster,
                       "--replica-cpus", "1", "--router-policy", "round_robin",
                       "--max-model-len", "512")
    try:
        _wait_healthy(srv, 2)
        log = "".join(srv.stderr)
        assert "2 replicas on Ray" in log
        assert log.count("(ReplicaActor pid=") >= 2  # each replica's log, through Ray
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        for i in range(4):
            if i % 2:
                out = client.completions.create(model=MODEL, prompt=f"Count to {i}:",
                                                max_tokens=6, temperature=0)
                assert out.choices[0].text and out.usage.completion_tokens == 6
            else:
                stream = client.chat.completions.create(
                    model=MODEL, max_tokens=6, temperature=0, stream=True,
                    messages=[{"role": "user", "content": f"Say {i}."}])
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text
        routed = _routed(srv)
        assert sorted(routed.values()) == [2.0, 2.0]  # round robin over both actors

        # A replica whose engine core dies exits; the router takes it out and the other
        # replica serves on.
        def core_pids():
            return [int(line.split("[servelm core ")[1].split("]")[0]) for line in srv.stderr
                    if "[servelm core " in line and "engine ready" in line]

        deadline = time.monotonic() + 30  # the actors' logs reach us through Ray, later
        while len(set(core_pids())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        cores = sorted(set(core_pids()))
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)
        _wait_healthy(srv, 1, timeout=30)
        for _ in range(2):
            out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
            assert out.usage.completion_tokens == 4
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(90)
    assert code == 0, "".join(srv.stderr[-30:])
    for url in routed:  # the actors stopped their replicas
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
