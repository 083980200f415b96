"""The router's /dashboard: the same page, its data every replica's merged (behind the
replicas' API key, which the router passes on)."""

from __future__ import annotations

import httpx
import pytest
from servers import Uvicorn, fake_server, metrics

KEY = "fleet-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fleet():
    from servelm.router.app import build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    replicas = [fake_server(api_key=KEY) for _ in range(2)]
    router = Uvicorn(build_router_app(ReplicaSet([r.url for r in replicas], 0.2, eject_after=2),
                                      make_policy("round_robin")))
    yield router, replicas
    router.stop()
    for r in replicas:
        r.stop()


def test_router_dashboard_merges_replicas(fleet):
    router, replicas = fleet
    page = httpx.get(router.url + "/dashboard")
    assert page.status_code == 200 and "dashboard/dashboard.js" in page.text
    assert httpx.get(router.url + "/dashboard/dashboard.js").status_code == 200
    assert httpx.get(router.url + "/dashboard/data").status_code == 401
    assert httpx.get(router.url + "/dashboard/data", headers=AUTH,
                     params={"window": "nope"}).status_code == 400
    with httpx.Client(base_url=router.url, headers=AUTH, timeout=30) as c:
        for i in range(6):
            r = c.post("/v1/completions", json={"model": "fake", "prompt": [5 + i] * 40,
                                                "max_tokens": 5 + i, "ignore_eos": True})
            assert r.status_code == 200, r.text
        d = c.get("/dashboard/data", params={"window": 300}).json()
    per_replica = [metrics(r.url, AUTH) for r in replicas]
    assert all(m["servelm_generation_tokens_total"] > 0 for m in per_replica)  # both served
    assert d["counters"]["generation_tokens"] == \
        sum(m["servelm_generation_tokens_total"] for m in per_replica) == sum(5 + i for i in range(6))
    assert d["window"]["num_requests"] == 6 and d["window"]["ttft_s"]["count"] == 6
    assert d["gauges"]["kv_blocks_total"] == sum(m["servelm_kv_blocks_total"] for m in per_replica)
    assert len(d["replicas"]) == 2 and all(r["reachable"] for r in d["replicas"])
    assert {s["replica"] for s in d["slowest"]} == {r.url for r in replicas}
    assert d["router"]["replicas_serving"] == 2


def test_doctor_on_the_router_asks_for_a_replica(fleet, capsys):
    from servelm.cli import main as servelm_main

    router, _ = fleet
    assert servelm_main(["doctor", "--url", router.url, "--api-key", KEY]) == 2
    assert "one replica" in capsys.readouterr().err
