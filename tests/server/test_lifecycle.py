"""`servelm serve` as a subprocess: queue limit (429), SIGTERM drain, request log lines."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from live_server import MODEL
from serve_process import ServeProcess


@pytest.fixture(scope="module")
def serve(default_model_path):
    p = ServeProcess("--max-num-seqs", "1", "--max-queue", "1", "--drain-timeout", "30")
    yield p
    if p.proc.poll() is None:
        p.proc.kill()
        p.proc.wait()


def _body(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True,
            "temperature": 0, **kw}


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ready_line_prints_the_url(serve):
    assert any(f"http://127.0.0.1:{serve.port}/v1" in line for line in serve.stderr)
    assert httpx.get(serve.url + "/health").json() == {"status": "ok"}
    assert httpx.get(serve.url + "/version").json()["version"]


def test_queue_limit_gives_429_with_retry_after(serve):
    background = []
    with httpx.Client(base_url=serve.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=_body(max_tokens=300, stream=True)) as a:
            lines = a.iter_lines()  # (kept referenced: closing it would drop A)
            next(line for line in lines if line)  # A runs (max-num-seqs 1)
            t = threading.Thread(target=lambda: background.append(
                httpx.post(serve.url + "/v1/completions", json=_body(max_tokens=3),
                           timeout=60)))
            t.start()
            _wait(lambda: serve.metric("servelm_num_requests_waiting") == 1)  # B waits
            r = c.post("/v1/completions", json=_body(max_tokens=3))
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
            del lines
        t.join(60)  # A was dropped; B runs
    assert background[0].status_code == 200
    assert background[0].json()["usage"]["completion_tokens"] == 3
    assert serve.metric('servelm_requests_rejected_total{reason="queue_full"}') == 1


def test_sigterm_drains_in_flight_requests_then_exits(serve):
    events = []

    def stream():
        body = _body(max_tokens=40, stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    t = threading.Thread(target=stream)
    t.start()
    _wait(lambda: len(events) >= 1)
    serve.proc.send_signal(signal.SIGTERM)
    _wait(lambda: httpx.get(serve.url + "/health").status_code == 503, timeout=10)
    r = httpx.post(serve.url + "/v1/completions", json=_body(max_tokens=2), timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
    t.join(60)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 40  # finished, not cut
    assert serve.proc.wait(30) == 0
    logs = [json.loads(line) for line in serve.stderr if line.startswith("{")]
    done = [rec for rec in logs if rec["stream"] and rec["timing"].get("completion_tokens") == 40]
    assert done and done[-1]["status"] == "finished"
    for key in ("queued_s", "prefill_s", "decode_s", "ttft_s", "num_preemptions",
                "num_cached_tokens"):
        assert key in done[-1]["timing"]
