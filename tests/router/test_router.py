"""The router end to end: the official openai client through it to real servelm servers
(model-free engines), replicas killed and restarted, a stream broken mid-way."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fake_runner
from fake_runner import FakeRunner, make_engine  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Uvicorn:
    """An ASGI app on a given port in a thread of this process."""

    def __init__(self, app, port: int):
        import uvicorn

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)

    def kill(self) -> socket.socket:
        """Stop, keeping the port: the socket returned holds it bound and not listening from
        the moment the server lets it go, so connections are refused and no other server
        started meanwhile (by a test before this one, say) can take it. Close it to free it."""
        port = int(self.url.rsplit(":", 1)[1])
        self.server.should_exit = True
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 30
        while True:
            try:
                sock.bind(("127.0.0.1", port))
                break
            except OSError:  # still listening: uvicorn closes it within a tick
                assert time.monotonic() < deadline, "the server kept its port"
                time.sleep(0.001)
        self.thread.join(30)
        return sock


def _replica(port: int) -> _Uvicorn:
    from servelm.server.app import ServerConfig, build_app

    engine = make_engine(num_blocks=256, max_num_batched_tokens=64,
                         runner=FakeRunner(step_s=0.002, block_size=4))
    return _Uvicorn(build_app(engine, ServerConfig(served_model_name="fake")), port)


def _router(urls, policy="round_robin", probe_interval=0.2) -> _Uvicorn:
    from servelm.router.app import build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    return _Uvicorn(build_router_app(ReplicaSet(urls, probe_interval, eject_after=2),
                                     make_policy(policy)), _port())


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def fleet():
    ports = [_port(), _port()]
    reps = [_replica(p) for p in ports]
    router = _router([r.url for r in reps])
    yield reps, router, ports
    router.stop()
    for r in reps:
        r.stop()


def test_openai_client_through_the_router_spreads_requests(fleet):
    reps, router, _ = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    for _ in range(3):
        out = client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=6,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 3
    stream = client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=5,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["fake"]
    m = _metrics(router.url)
    routed = [m[f'servelm_router_requests_total{{replica="{r.url}"}}'] for r in reps]
    assert sum(routed) == 5 and min(routed) >= 2  # round robin over both (models too)
    # Errors pass through as the replica wrote them (a 400 naming the parameter).
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake", prompt=[5], max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"


def test_a_dead_replica_is_retried_around_ejected_and_readmitted(fleet):
    reps, router, ports = fleet
    held = reps[0].kill()
    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    for _ in range(4):  # nothing lost: a failure before the first byte goes elsewhere
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-servelm-replica"] == reps[1].url
    healthy = f'servelm_router_replica_healthy{{replica="{reps[0].url}"}}'
    _wait(lambda: _metrics(router.url)[healthy] == 0, 5)
    m = _metrics(router.url)
    assert m["servelm_router_retries_total"] >= 1
    assert m[f'servelm_router_ejections_total{{replica="{reps[0].url}"}}'] == 1
    held.close()
    reps[0] = _replica(ports[0])  # back on the same address
    _wait(lambda: _metrics(router.url)[healthy] == 1, 5)
    seen = {httpx.post(router.url + "/v1/completions", json=body).headers["x-servelm-replica"]
            for _ in range(4)}
    assert seen == {reps[0].url, reps[1].url}


def test_requests_with_one_idempotency_key_go_to_one_replica(fleet):
    reps, router, _ = fleet
    body = {"model": "fake", "prompt": [4, 4], "max_tokens": 3}
    first = httpx.post(router.url + "/v1/completions", json=body,
                       headers={"Idempotency-Key": "k-1"})
    again = [httpx.post(router.url + "/v1/completions", json=body,
                        headers={"Idempotency-Key": "k-1"}) for _ in range(3)]
    assert {r.headers["x-servelm-replica"] for r in [first, *again]} \
        == {first.headers["x-servelm-replica"]}
    assert all(r.json() == first.json() for r in again)  # the replica's store answered


def test_a_stream_that_breaks_mid_way_ends_with_an_error_event():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def events():
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        yield b'data: {"choices": [{"text": "b"}]}\n\n'
        raise RuntimeError("replica died")  # uvicorn drops the connection mid-body

    async def completions(request):
        return StreamingResponse(events(), media_type="text/event-stream")

    async def ok(request):
        return JSONResponse({"status": "ok"})

    bad = _Uvicorn(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                     Route("/health", ok), Route("/metrics", ok)]), _port())
    router = _router([bad.url])
    try:
        with httpx.stream("POST", router.url + "/v1/completions",
                          json={"prompt": [1], "stream": True}, timeout=30) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[:2] == ['data: {"choices": [{"text": "a"}]}',
                             'data: {"choices": [{"text": "b"}]}']
        err = json.loads(lines[2][len("data: "):])["error"]
        assert err["code"] == "replica_failed" and "broke mid-way" in err["message"]
        assert lines[-1] == "data: [DONE]"
        assert _metrics(router.url)["servelm_router_broken_streams_total"] == 1
    finally:
        router.stop()
        bad.stop()


def _affinity_replica(port: int, step_s: float = 0.002) -> _Uvicorn:
    from servelm.server.app import ServerConfig, build_app

    engine = make_engine(num_blocks=256, max_num_batched_tokens=256, prefix_caching=True,
                         runner=FakeRunner(step_s=step_s, block_size=4))
    return _Uvicorn(build_app(engine, ServerConfig(served_model_name="fake")), port)


def test_prefix_affinity_follows_each_replicas_kv_events_and_usage_reports_the_hit():
    reps = [_affinity_replica(_port()) for _ in range(2)]
    router = _router([r.url for r in reps], policy="prefix_affinity", probe_interval=0.1)
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
        shared = list(range(100, 180))  # 80 tokens: 20 blocks of 4
        raw = client.completions.with_raw_response.create(
            model="fake", prompt=shared + [1], max_tokens=2, extra_body={"ignore_eos": True})
        home = raw.headers["x-servelm-replica"]
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0
        view = f'servelm_router_replica_cache_view_blocks{{replica="{home}"}}'
        _wait(lambda: _metrics(router.url)[view] >= 20, 5)
        for i in range(5):  # the same long prefix, new suffixes: all to the replica holding it
            raw = client.completions.with_raw_response.create(
                model="fake", prompt=shared + [2 + i, 3], max_tokens=2,
                extra_body={"ignore_eos": True})
            assert raw.headers["x-servelm-replica"] == home
            assert raw.parse().usage.prompt_tokens_details.cached_tokens == 80
        m = _metrics(router.url)
        assert m[f'servelm_router_estimated_hit_tokens_total{{replica="{home}"}}'] == 5 * 80
        # The replica's own counter agrees with the router's estimate.
        _wait(lambda: _metrics(router.url)[
            f'servelm_router_replica_reported_hit_tokens{{replica="{home}"}}'] == 5 * 80, 5)
        # A salted request is another namespace: no expected hit, placed by load.
        other = client.completions.with_raw_response.create(
            model="fake", prompt=shared + [9], max_tokens=2,
            extra_body={"ignore_eos": True, "cache_salt": "tenant-b"})
        assert other.parse().usage.prompt_tokens_details.cached_tokens == 0
    finally:
        router.stop()
        for r in reps:
            r.stop()


def test_a_replicas_load_counts_only_the_uncached_work_it_was_sent():
    rep = _affinity_replica(_port(), step_s=0.05)  # 20 tokens/s: the stream lasts seconds
    router = _router([rep.url], policy="prefix_affinity", probe_interval=0.1)
    load = f'servelm_router_replica_tokens_in_flight{{replica="{rep.url}"}}'
    body = {"model": "fake", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    shared = list(range(100, 180))  # 20 blocks of 4
    try:
        first = httpx.post(router.url + "/v1/completions", timeout=30, json={
            "model": "fake", "prompt": shared + [1], "max_tokens": 1})
        assert first.status_code == 200, first.text
        view = f'servelm_router_replica_cache_view_blocks{{replica="{rep.url}"}}'
        _wait(lambda: _metrics(router.url)[view] >= 20, 5)
        for prompt, expected in ((shared + [7, 8, 9], 83 - 80 + 40),  # a hit: 3 + 40
                                 (list(range(300, 383)), 83 + 40)):  # a miss: all of it
            out = {}
            sender = threading.Thread(target=lambda p=prompt: out.update(r=httpx.post(
                router.url + "/v1/completions", timeout=30, json={**body, "prompt": p})))
            sender.start()
            seen = set()
            while sender.is_alive():  # (the fake's tokens come out as one chunk at the end)
                seen.add(_metrics(router.url)[load])
                time.sleep(0.05)
            assert max(seen) == expected, seen
            lines = [x for x in out["r"].text.splitlines() if x.startswith("data: {")]
            assert json.loads(lines[-1][6:])["usage"]["completion_tokens"] == 40
            _wait(lambda: _metrics(router.url)[load] == 0, 5)
    finally:
        router.stop()
        rep.stop()


def test_kv_events_page_through_and_reset_when_a_reader_falls_behind():
    from servelm.core.contract import KVEvent
    from servelm.core.kv_event_log import KVEventLog

    log = KVEventLog(capacity=5)
    log.extend([KVEvent(0, h, 0) for h in range(3)])
    events, nxt, reset = log.since(0)
    assert [e.hash for e in events] == [0, 1, 2] and nxt == 3 and not reset
    log.extend([KVEvent(0, h, 0) for h in range(3, 9)])  # 9 events, the first 4 dropped
    events, nxt, reset = log.since(3)
    assert reset and [e.hash for e in events] == [4, 5, 6, 7, 8] and nxt == 9
    assert log.since(9) == ([], 9, False)


def test_the_router_checks_a_requests_slo_class_and_sends_it_by_name(tmp_path):
    """--slo-spec at the router: a bad class is a 400 naming the field before any replica
    is chosen; a class named by priority reaches the replica as slo_class (the replica, with
    the same spec, counts it in that class)."""
    import json

    from servelm.router.app import RouterConfig, build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet
    from servelm.server.app import ServerConfig, build_app

    spec = tmp_path / "slo.json"
    spec.write_text(json.dumps({"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": 60000, "tpot_ms": 60000},
        {"name": "batch", "priority": 1, "ttft_ms": 60000, "tpot_ms": 60000}]}))
    engine = make_engine(num_blocks=256, max_num_batched_tokens=64,
                         runner=FakeRunner(step_s=0.002, block_size=4))
    rep = _Uvicorn(build_app(engine, ServerConfig(served_model_name="fake",
                                                  slo_spec=str(spec))), _port())
    router = _Uvicorn(build_router_app(ReplicaSet([rep.url], 0.2, eject_after=2),
                                       make_policy("round_robin"),
                                       RouterConfig(slo_spec=str(spec))), _port())
    try:
        _wait(lambda: httpx.get(router.url + "/health").status_code == 200)
        body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        for extra, param in (({"priority": 9}, "priority"), ({"slo_class": "gold"}, "slo_class"),
                             ({"priority": "1"}, "priority")):
            r = httpx.post(router.url + "/v1/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert httpx.post(router.url + "/v1/completions",
                          json={**body, "priority": 1}).status_code == 200
        assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
        m = _metrics(router.url)
        assert m['servelm_router_requests_by_class_total{slo_class="batch"}'] == 1
        assert m['servelm_router_requests_by_class_total{slo_class="interactive"}'] == 1
        assert sum(v for k, v in m.items() if k.startswith("servelm_router_requests_total")) == 2
        _wait(lambda: _metrics(rep.url).get(
            'servelm_slo_window_requests{slo_class="batch"}') == 1)
    finally:
        router.stop()
        rep.stop()
