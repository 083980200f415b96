"""OpenTelemetry spans per request (the SDK's in-memory exporter): the front end, queue,
prefill steps, decode and stream, parented by the client's W3C traceparent, through the
router too; off unless configured."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is in the test extra")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from servers import Uvicorn, fake_server

from servelm.tracing import Tracing, TracingMiddleware, install

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _traced_server(exporter, **kw):
    def setup(app):
        state = app.state.servelm
        install(app, state.metrics.recorder, "fake", exporter=exporter)

    return fake_server(setup=setup, per_token_s=2e-5, max_num_batched_tokens=64, **kw)


def _body(stream: bool) -> dict:
    return {"model": "fake", "prompt": [7 + j % 50 for j in range(200)], "max_tokens": 6,
            "ignore_eos": True, "stream": stream}


def _by_name(spans):
    out = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_spans_of_a_streamed_request():
    mem = InMemorySpanExporter()
    s = _traced_server(mem)
    try:
        r = httpx.post(s.url + "/v1/completions", json=_body(True),
                       headers={"traceparent": TRACEPARENT}, timeout=30)
        assert r.status_code == 200 and "[DONE]" in r.text
        records = httpx.get(s.url + "/dashboard/data", params={"records": 1}).json()["records"]
        httpx.get(s.url + "/v1/models")
    finally:
        s.stop()
    spans = _by_name(mem.get_finished_spans())
    (root,) = spans["POST /v1/completions"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID
    assert root.attributes["http.response.status_code"] == 200
    for name in ("host", "queue", "prefill", "decode", "stream"):
        (child,) = spans[name]
        assert child.parent.span_id == root.context.span_id, name
        assert child.context.trace_id == root.context.trace_id
        assert child.start_time <= child.end_time
    # A 200-token prompt in a 64-token budget: its chunks are at least four steps.
    steps = spans["prefill step"]
    assert len(steps) >= 4
    assert all(st.parent.span_id == spans["prefill"][0].context.span_id for st in steps)
    assert max(st.attributes["servelm.step.max_chunk"] for st in steps) == 64
    assert spans["queue"][0].end_time <= spans["prefill"][0].start_time + 1_000_000
    assert spans["prefill"][0].end_time <= spans["decode"][0].end_time
    assert spans["decode"][0].attributes["servelm.num_output_tokens"] == 6
    assert records[-1]["trace_id"] == TRACE_ID
    assert "GET /v1/models" in spans  # every API route, not only completions


def test_tracing_is_off_unless_configured():
    s = fake_server()
    try:
        assert not any(m.cls is TracingMiddleware for m in s.app.user_middleware)
        r = httpx.post(s.url + "/v1/completions", json=_body(False),
                       headers={"traceparent": TRACEPARENT}, timeout=30)
        assert r.status_code == 200
        rec = httpx.get(s.url + "/dashboard/data", params={"records": 1}).json()["records"][-1]
        assert rec["trace_id"] is None
    finally:
        s.stop()


def test_bad_endpoint_names_the_parameter():
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        Tracing("x", endpoint="localhost:4318")


@pytest.mark.parametrize("router_traced", [False, True])
def test_trace_context_crosses_the_router(router_traced):
    from servelm.router.app import build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    mem = InMemorySpanExporter()
    replica = _traced_server(mem)
    router_mem = InMemorySpanExporter()
    tracing = Tracing("router", exporter=router_mem) if router_traced else None
    router = Uvicorn(build_router_app(ReplicaSet([replica.url], 0.2), make_policy("round_robin"),
                                      tracing=tracing))
    try:
        for stream in (False, True):
            r = httpx.post(router.url + "/v1/completions", json=_body(stream),
                           headers={"traceparent": TRACEPARENT}, timeout=30)
            assert r.status_code == 200
    finally:
        router.stop()
        replica.stop()
    roots = _by_name(mem.get_finished_spans())["POST /v1/completions"]
    assert len(roots) == 2
    assert all(f"{s.context.trace_id:032x}" == TRACE_ID for s in roots)
    if not router_traced:
        assert all(f"{s.parent.span_id:016x}" == PARENT_ID for s in roots)
        return
    hops = _by_name(router_mem.get_finished_spans())["router POST /v1/completions"]
    assert len(hops) == 2
    assert all(f"{h.parent.span_id:016x}" == PARENT_ID for h in hops)
    assert {s.parent.span_id for s in roots} == {h.context.span_id for h in hops}


def test_the_endpoint_flag_exports_over_otlp_http():
    """`--otlp-traces-endpoint`: the standard OTLP/HTTP exporter posts the spans (protobuf) to
    the collector; here a stand-in collector records what it receives."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    received = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_port}/v1/traces"
    s = fake_server(otlp_traces_endpoint=endpoint)
    try:
        (mw,) = [m for m in s.app.user_middleware if m.cls is TracingMiddleware]
        r = httpx.post(s.url + "/v1/completions", json=_body(False), timeout=30,
                       headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200
        tracing = mw.kwargs["tracing"]
        assert tracing.provider.force_flush(10_000)
    finally:
        s.stop()
        tracing.shutdown()
        collector.shutdown()
    assert received, "no spans reached the collector"
    path, content_type, _ = received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    payload = b"".join(b for _, _, b in received)
    for name in (b"POST /v1/completions", b"queue", b"prefill step", b"decode"):
        assert name in payload
    assert bytes.fromhex(TRACE_ID) in payload
