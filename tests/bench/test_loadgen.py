"""Arrival processes (statistically, no server) and the streaming client against a fake
OpenAI-compatible server with known delays (uvicorn in a thread on 127.0.0.1)."""

import contextlib
import json
import socket
import statistics
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from servelm.bench.fake_server import FakeBehaviour, FakeServer
from servelm.bench.loadgen import EndpointConfig, LoadSpec, arrival_offsets, run_load
from servelm.bench.workloads import Request, random_lengths


# --- arrivals ------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    rate, n = 5.0, 20_000
    t = arrival_offsets(n, rate, "poisson", seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    # Mean gap of n exponential draws: standard error 1/(rate*sqrt(n)) = 0.7%; allow ~4 sigma.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # CV of an exponential
    # Counts in 1-second windows are Poisson: variance equals the mean.
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)
    # Memoryless: P(gap > 1/rate) = e^-1.
    assert (gaps > 1 / rate).mean() == pytest.approx(np.exp(-1), abs=0.015)


def test_arrivals_are_seeded():
    a = arrival_offsets(100, 2.0, seed=7)
    assert np.array_equal(a, arrival_offsets(100, 2.0, seed=7))
    assert not np.array_equal(a, arrival_offsets(100, 2.0, seed=8))


def test_constant_burst_and_batch_arrivals():
    assert np.allclose(arrival_offsets(4, 2.0, "constant"), [0, 0.5, 1.0, 1.5])
    b = arrival_offsets(8000, 4.0, "burst", burst_size=8, seed=0)
    groups = b.reshape(-1, 8)
    assert np.all(groups == groups[:, :1])  # each burst leaves together
    assert (len(b) - 1) / b[-1] == pytest.approx(4.0, rel=0.1)  # mean rate is still the rate
    assert np.all(arrival_offsets(5, float("inf")) == 0)
    for bad in (dict(rate=0), dict(rate=-1), dict(rate=1, kind="gamma")):
        with pytest.raises(ValueError):
            arrival_offsets(3, **bad)


# --- the client against a fake server ------------------------------------------------------


def _requests(n, out_len, seed=0):
    return random_lengths(n, (8, 16), (out_len, out_len), 1000, seed=seed)


def test_measured_ttft_and_tpot_match_the_injected_delays():
    ttft, tpot, n_out = 0.2, 0.05, 10
    with FakeServer(FakeBehaviour(ttft_s=ttft, tpot_s=tpot)) as server:
        cfg = EndpointConfig(server.url, "fake")
        res = run_load(cfg, _requests(6, n_out), LoadSpec(concurrency=3),
                       warmup=_requests(1, 2, seed=1))
    recs = res.records
    assert len(recs) == 6 and all(r.is_ok for r in recs)
    assert all(r.num_output_tokens == n_out and r.has_usage for r in recs)
    assert all(len(r.chunk_times) == n_out for r in recs)
    ttfts = [r.ttft_s for r in recs]
    tpots = [r.tpot_s for r in recs]
    # Never earlier than injected; late by at most scheduling noise on a busy machine.
    assert min(ttfts) >= ttft - 0.005
    assert statistics.median(ttfts) == pytest.approx(ttft, abs=0.06)
    assert statistics.median(tpots) == pytest.approx(tpot, abs=0.01)
    itls = [g for r in recs for g in r.itls_s]
    assert statistics.median(itls) == pytest.approx(tpot, abs=0.015)
    assert all(r.write_s is not None and r.write_s >= 0 for r in recs)
    assert res.elapsed_s >= ttft + (n_out - 1) * tpot


def test_open_loop_sends_on_schedule():
    """Requests go out on the arrival schedule, each lasting longer than the gap between
    arrivals (0.3 s against 0.05 s), so an open loop has several in flight at once."""
    rate, n = 20.0, 12
    with FakeServer(FakeBehaviour(ttft_s=0.3, tpot_s=0.005)) as server:
        res = run_load(EndpointConfig(server.url, "fake"), _requests(n, 4),
                       LoadSpec(request_rate=rate, arrival="constant"))
    recs = res.records
    assert all(r.is_ok for r in recs)
    sched = [r.scheduled_time - recs[0].scheduled_time for r in recs]
    assert sched == pytest.approx(list(np.arange(n) / rate), abs=1e-6)
    # never sent before its time (up to the event loop's clock granularity); how late the
    # client was shows in send_delay_s, not in TTFT
    assert all(r.send_delay_s >= -1e-3 and r.ttft_s >= 0.3 for r in recs)
    # open loop: a send does not wait for the previous request's answer
    assert any(b.sent_time < a.end_time for a, b in zip(recs, recs[1:]))
    assert res.loop_lag_s  # the lag sampler ran


def test_failures_are_classified_by_kind():
    with FakeServer(FakeBehaviour(ttft_s=0.01, tpot_s=0.005, fail_every=3, fail_status=503,
                                  cut_every=4)) as server:
        res = run_load(EndpointConfig(server.url, "fake"), _requests(8, 3),
                       LoadSpec(concurrency=1))
    kinds = [r.error for r in res.records]
    # Requests 3 and 6 get 503; 4 and 8 are cut after one token (no [DONE]).
    assert kinds == [None, None, "http_503", "stream", None, "http_503", None, "stream"]
    assert "injected" in res.records[2].error_detail

    with FakeServer(FakeBehaviour(ttft_s=2.0)) as server:
        res = run_load(EndpointConfig(server.url, "fake", timeout_s=0.3), _requests(2, 2),
                       LoadSpec(concurrency=2))
    assert [r.error for r in res.records] == ["timeout", "timeout"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_load(EndpointConfig(f"http://127.0.0.1:{port}", "fake", timeout_s=5),
                   _requests(2, 2), LoadSpec(concurrency=1))
    assert [r.error for r in res.records] == ["connection", "connection"]
    with pytest.raises(ConnectionError):
        run_load(EndpointConfig(f"http://127.0.0.1:{port}", "fake", timeout_s=5),
                 _requests(1, 2), LoadSpec(concurrency=1), warmup=_requests(1, 2))


def test_request_bodies_for_ids_text_and_chat():
    req = Request([101, 102, 103], 7)
    ids = EndpointConfig("http://127.0.0.1:1", "m").body(req)
    assert ids["prompt"] == [101, 102, 103] and ids["max_tokens"] == 7
    assert ids["ignore_eos"] is True and ids["min_tokens"] == 7
    assert ids["stream"] is True and ids["stream_options"] == {"include_usage": True}
    text = EndpointConfig("http://127.0.0.1:1/v1", "m", prompt_format="text",
                          ignore_eos=False, extra_body={"top_k": 1}).body(req)
    assert isinstance(text["prompt"], str) and len(text["prompt"].split()) == 3
    assert "ignore_eos" not in text and text["top_k"] == 1
    chat = EndpointConfig("http://127.0.0.1:1", "m", endpoint="chat")
    assert chat.url == "http://127.0.0.1:1/v1/chat/completions"
    assert chat.body(req)["messages"][0]["content"] == text["prompt"]


def test_chat_stream_is_measured_too():
    with FakeServer(FakeBehaviour(ttft_s=0.05, tpot_s=0.02)) as server:
        res = run_load(EndpointConfig(server.url, "fake", endpoint="chat"), _requests(2, 5),
                       LoadSpec(concurrency=2))
    assert all(r.is_ok and r.num_output_tokens == 5 and len(r.chunk_times) == 5
               for r in res.records)


def test_duration_bounds_the_run_and_in_flight_requests_finish():
    with FakeServer(FakeBehaviour(ttft_s=0.02, tpot_s=0.02)) as server:
        res = run_load(EndpointConfig(server.url, "fake"), _requests(500, 5),
                       LoadSpec(concurrency=2, duration_s=0.5))
    assert 2 <= len(res.records) < 100  # ~0.1 s per request, two at a time, for 0.5 s
    assert all(r.is_ok for r in res.records)  # none cut off at the deadline
    # none started after the deadline (the first started at the run's start, or after it)
    starts = [r.scheduled_time for r in res.records]
    assert max(starts) - min(starts) <= 0.5
    assert res.elapsed_s >= 0.5


@contextlib.contextmanager
def _serve(app):
    """Run a hand-written app (uvicorn in a thread) on a free port; yield its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


def test_malformed_events_fail_the_request_not_the_run():
    app = FastAPI()
    bodies = iter([b'data: {"choices": ["x"]}\n\n', b"data: not json\n\n",
                   b'data: {"error": {"message": "boom"}}\n\n'])

    @app.post("/v1/chat/completions")
    async def chat():
        body = next(bodies)
        return StreamingResponse(iter([body, b"data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    with _serve(app) as url:
        res = run_load(EndpointConfig(url, "m", endpoint="chat"), _requests(3, 2),
                       LoadSpec(concurrency=1))
    assert [r.error for r in res.records] == ["stream", "stream", "stream"]
    assert "boom" in res.records[2].error_detail


def test_a_closing_chunk_with_only_a_finish_reason_is_not_a_token():
    # llama-cpp-python's server streams one chunk per token, then {"text": "",
    # "finish_reason": "length"}, and no usage: counted by chunks, that closing chunk would
    # add a token and a ~0 ms inter-token gap. An empty chunk *without* finish_reason is
    # still a token step (a token whose text the detokenizer holds back).
    def event(text, finish=None):
        chunk = {"object": "text_completion",
                 "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        body = [event(" a"), event(""), event(" c"), event("", "length"), b"data: [DONE]\n\n"]
        return StreamingResponse(iter(body), media_type="text/event-stream")

    with _serve(app) as url:
        res = run_load(EndpointConfig(url, "m", prompt_format="text"), _requests(2, 3),
                       LoadSpec(concurrency=1))
    for rec in res.records:
        assert rec.is_ok and not rec.has_usage
        assert rec.num_output_tokens == 3 and len(rec.chunk_times) == 3
