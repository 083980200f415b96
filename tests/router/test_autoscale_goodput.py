"""The live controller's SLO rule: each class's goodput over the spec's window, read from the
replicas' own gauges and combined by counts (met / finished, summed over the replicas: not a
mean of their ratios), passed to the policy as the simulator passes it. Unit tests of the
reading and the combining; then the controller in a router's loop over model-free servelm
servers (the real scheduler and server, a fake model), the same spec file read by the
servers, the router and the policy."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "observability"))
from servers import Uvicorn, fake_server  # noqa: E402

from servelm.autoscale.controller import (AutoscaleController, ClassWindow,  # noqa: E402
                                          combine_goodput, parse_slo_window)
from servelm.autoscale.policy import AutoscaleConfig, Autoscaler  # noqa: E402


def _spec(tmp_path, interactive_ttft_ms: float) -> str:
    path = tmp_path / "slo.json"
    path.write_text(json.dumps({"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": interactive_ttft_ms,
         "tpot_ms": 60000, "percentile": 90},
        {"name": "batch", "priority": 1, "ttft_ms": 60000, "tpot_ms": 60000,
         "percentile": 50}], "default_class": "interactive", "window_s": 600}))
    return str(path)


# -- reading and combining ------------------------------------------------------------------

def test_two_replicas_combine_by_counts_not_by_their_ratios(tmp_path):
    """9 of 10 met on one replica, 10 of 100 on the other: the fleet met 19 of 110 (17%),
    below a 50% target; the mean of the two ratios (50%) would say it is met."""
    a = {"batch": ClassWindow(9, 10)}
    b = {"batch": ClassWindow(10, 100), "interactive": ClassWindow(4, 4)}
    goodput = combine_goodput(["interactive", "batch"], [a, b])
    assert goodput["batch"] == (19 / 110, 110)
    assert goodput["interactive"] == (1.0, 4)  # reported by one replica only
    assert combine_goodput(["batch"], []) == {"batch": (None, 0)}  # nothing finished

    t = [0.0]
    scaler = Autoscaler(AutoscaleConfig(target=1e9, min_replicas=2, max_replicas=3,
                                        slo_spec=_spec(tmp_path, 60000)), lambda: t[0])
    assert scaler.decide(0, 2, 0, goodput).reason == "slo:batch"
    mean_of_ratios = {"batch": ((0.9 + 0.1) / 2, 110), "interactive": (1.0, 4)}
    t[0] += 1
    assert Autoscaler(scaler.config, lambda: t[0]).decide(0, 2, 0,
                                                         mean_of_ratios).reason == "hold"


def test_the_window_gauges_are_read_from_a_metrics_page():
    page = "\n".join([
        "# HELP servelm_slo_window_requests Requests finished in the last window_s seconds",
        "# TYPE servelm_slo_window_requests gauge",
        'servelm_slo_goodput_ratio{slo_class="interactive"} NaN',
        'servelm_slo_window_requests{slo_class="interactive"} 0.0',
        'servelm_slo_window_met_requests{slo_class="interactive"} 0.0',
        'servelm_slo_window_requests{slo_class="batch"} 7.0',
        'servelm_slo_window_met_requests{slo_class="batch"} 8.0',  # a finish between reads
        'servelm_slo_window_requests{slo_class="say \\"hi\\""} 3.0',
        'servelm_slo_window_met_requests{slo_class="say \\"hi\\""} 2.0',
        'servelm_slo_window_requests{slo_class="half"} 5.0',  # its met count missing
        'servelm_slo_window_requests_total{slo_class="other"} 5.0',
        "servelm_num_requests_running 3.0", ""])
    assert parse_slo_window(page) == {"interactive": ClassWindow(0, 0),
                                      "batch": ClassWindow(7, 7),
                                      'say "hi"': ClassWindow(2, 3)}


def test_the_server_reports_the_met_count_beside_the_ratio(tmp_path):
    """The gauges the controller reads, from a real server: met, requests and the ratio
    agree (met = ratio x requests)."""
    srv = fake_server(slo_spec=_spec(tmp_path, 60000))
    try:
        for prio in (0, 0, 1):
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": "fake", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True,
                "priority": prio})
            assert r.status_code == 200, r.text
        page = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    window = parse_slo_window(page)
    assert window == {"interactive": ClassWindow(2, 2), "batch": ClassWindow(1, 1)}
    assert 'servelm_slo_goodput_ratio{slo_class="interactive"} 1.0' in page


# -- the controller on a live router ---------------------------------------------------------

class SLOBackend:
    """Starts a model-free servelm server with the fleet's SLO spec; stops it."""

    def __init__(self, spec: str):
        self.spec = spec
        self.started: list = []
        self.stopped: list = []

    async def start_replica(self):
        srv = await asyncio.to_thread(fake_server, slo_spec=self.spec)
        self.started.append(srv)
        return srv, srv.url

    async def stop_replica(self, srv) -> None:
        await asyncio.to_thread(srv.stop)
        self.stopped.append(srv)


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _interactive_counts(replicas) -> list[int]:
    return [parse_slo_window(httpx.get(r.url + "/metrics").text)["interactive"].num_requests
            for r in replicas.replicas]


def _run_fleet(spec: str, check) -> None:
    """Two replicas behind a round-robin router with the spec, the controller in its loop
    (tokens-in-flight target out of reach, no scale-down within the test: only the SLO rule
    can act); 12 interactive then 4 batch requests, one at a time: no replica finishes
    slo_min_requests (10) of a class, the fleet does. Then `check(controller, replicas,
    backend, router_url)`."""
    from servelm.router.app import RouterConfig, build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    reps = [fake_server(slo_spec=spec) for _ in range(2)]
    config = AutoscaleConfig(target=1e9, min_replicas=2, max_replicas=3, up_window_s=60,
                             down_cooldown_s=600, tick_s=0.2, slo_spec=spec,
                             slo_min_requests=10, drain_timeout_s=30)
    backend = SLOBackend(spec)
    controller = AutoscaleController(config, backend, {r.url: r for r in reps})
    replicas = ReplicaSet([r.url for r in reps], probe_interval=0.2)
    replicas.controllers = [controller]
    router = Uvicorn(build_router_app(replicas, make_policy("round_robin"),
                                      RouterConfig(slo_spec=spec)))
    try:
        for prio in [0] * 12 + [1] * 4:
            r = httpx.post(router.url + "/v1/completions", timeout=30, json={
                "model": "fake", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                "ignore_eos": True, "priority": prio})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        check(controller, replicas, backend, router.url)
    finally:
        router.stop()
        for srv in [*reps, *backend.started]:
            if srv not in backend.stopped:
                srv.stop()


def test_missed_slo_orders_one_replica_with_the_class_as_reason(tmp_path):
    """Interactive's TTFT target is a microsecond: every interactive request misses it, and
    the controller, reading the two replicas' windows, orders one replica (slo:interactive);
    batch met all of its requests."""
    def check(controller, replicas, backend, router_url):
        _wait(lambda: len(replicas.healthy) == 3)
        assert [(d.reason, d.delta) for d in controller.events] == [("slo:interactive", 1)]
        counts = _interactive_counts(replicas)  # the third may have had the last few
        assert sum(counts) == 12 and max(counts) < 10
        assert len(backend.started) == 1
        assert backend.started[0].url in {r.url for r in replicas.healthy}
        # the last requests may have finished after the tick that scaled
        _wait(lambda: controller.goodput == {"interactive": (0.0, 12), "batch": (1.0, 4)})
        m = {}
        for line in httpx.get(router_url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                m[name] = float(value)
        assert m['servelm_router_autoscale_events_total{direction="up"}'] == 1

    _run_fleet(_spec(tmp_path, 0.001), check)


def test_met_slo_orders_nothing(tmp_path):
    """The same fleet and requests with targets every request meets: the controller reads
    all 16 (so the rule had its input) and orders nothing."""
    def check(controller, replicas, backend, router_url):
        _wait(lambda: controller.goodput is not None
              and controller.goodput["interactive"][1] == 12
              and controller.goodput["batch"][1] == 4)
        time.sleep(1.0)  # five more ticks
        assert controller.goodput == {"interactive": (1.0, 12), "batch": (1.0, 4)}
        assert list(controller.events) == [] and backend.started == []
        assert len(replicas.healthy) == 2
        assert _interactive_counts(replicas) == [6, 6]

    _run_fleet(_spec(tmp_path, 60000), check)


def test_a_replica_that_does_not_answer_counts_nothing(tmp_path):
    """read_goodput over one live replica and one URL nothing listens on: the live one's
    counts alone, no error."""
    from servelm.router.replicas import ReplicaSet

    spec = _spec(tmp_path, 60000)
    srv = fake_server(slo_spec=spec)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": "fake", "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        replicas = ReplicaSet([srv.url, "http://127.0.0.1:9"], probe_timeout=1.0)
        controller = AutoscaleController(AutoscaleConfig(target=100, slo_spec=spec),
                                         SLOBackend(spec), {})

        async def read():
            async with httpx.AsyncClient() as client:
                return await controller.read_goodput(replicas, client)

        goodput = asyncio.run(read())
    finally:
        srv.stop()
    assert goodput == {"interactive": (1.0, 1), "batch": (None, 0)}


def test_a_replica_with_another_spec_is_named_once_and_counts_nothing(tmp_path, caplog):
    """A replica started without the policy's --slo-spec has only the flags' one class
    (`default`): the policy's classes count nothing there, and the log says so once."""
    from servelm.router.replicas import ReplicaSet

    spec = _spec(tmp_path, 60000)
    srv = fake_server()
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": "fake", "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        replicas = ReplicaSet([srv.url])
        controller = AutoscaleController(AutoscaleConfig(target=100, slo_spec=spec),
                                         SLOBackend(spec), {})

        async def read_twice():
            async with httpx.AsyncClient() as client:
                await controller.read_goodput(replicas, client)
                return await controller.read_goodput(replicas, client)

        with caplog.at_level("WARNING", logger="servelm.autoscale.controller"):
            goodput = asyncio.run(read_twice())
    finally:
        srv.stop()
    assert goodput == {"interactive": (None, 0), "batch": (None, 0)}
    said = [r.getMessage() for r in caplog.records if "no goodput window" in r.getMessage()]
    assert len(said) == 1 and srv.url in said[0] and "'batch', 'interactive'" in said[0]
