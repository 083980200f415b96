"""Dropped connections, many streams, retries with Idempotency-Key, deadlines."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx

from live_server import MODEL


def _body(**kw):
    return {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "temperature": 0,
            "ignore_eos": True, **kw}


def _events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _finished(server, reason: str) -> float:
    return server.metrics()[f'servelm_requests_finished_total{{finish_reason="{reason}"}}']


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborts = _finished(server, "abort")
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=_body(max_tokens=400, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line]
            assert got and got[0].startswith("data: ")
            m = server.metrics()
            assert m["servelm_kv_blocks_used"] > 0  # it holds blocks while it runs
        # leaving the block closes the connection mid-stream
    m = server.wait_idle(timeout=5)
    assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
    assert m["servelm_num_requests_running"] == 0
    assert _finished(server, "abort") == aborts + 1


def test_disconnect_of_non_streaming_request_aborts_it(server):
    aborts = _finished(server, "abort")
    body = json.dumps(_body(max_tokens=400)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while server.metrics()["servelm_num_requests_running"] == 0:  # wait until it runs
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    m = server.wait_idle(timeout=5)
    assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
    assert _finished(server, "abort") == aborts + 1


def test_fifty_streams_ten_dropped_the_rest_complete(server):
    max_tokens, num_streams, num_dropped = 8, 50, 10

    async def one(client: httpx.AsyncClient, i: int):
        body = _body(prompt=f"Story number {i}:", max_tokens=max_tokens, stream=True,
                     stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                lines.append(line)
                if i < num_dropped and len(lines) == 1:
                    return None  # drop the connection after the first event
        return _events(lines)

    async def main():
        limits = httpx.Limits(max_connections=num_streams + 5)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num_streams)))

    results = asyncio.run(main())
    completed = [r for r in results if r is not None]
    assert len(completed) == num_streams - num_dropped
    for events in completed:
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == max_tokens
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        finish = [e["choices"][0]["finish_reason"] for e in events[:-2]
                  if e["choices"][0]["finish_reason"]]
        assert finish == ["length"] and text
    m = server.wait_idle(timeout=10)
    assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]


def test_idempotency_key_attaches_to_the_in_flight_request(server):
    finished = _finished(server, "length")
    body = _body(max_tokens=12, temperature=1.0)  # unseeded: two runs would differ
    headers = {"Idempotency-Key": "retry-1"}
    out = []

    def call():
        with server.client() as c:
            out.append(c.post("/v1/completions", json=body, headers=headers))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    with server.client() as c:
        replay = c.post("/v1/completions", json=body, headers=headers)  # after it finished
        conflict = c.post("/v1/completions", json={**body, "max_tokens": 3}, headers=headers)
    assert [r.status_code for r in out] == [200, 200] and replay.status_code == 200
    assert out[0].json() == out[1].json() == replay.json()
    assert replay.headers["x-servelm-timing"]
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_key_reused"
    assert _finished(server, "length") == finished + 1  # it ran once
    assert server.metrics()["servelm_idempotent_replays_total"] >= 2


def test_idempotent_stream_survives_a_drop_and_is_replayed_on_retry(server):
    body = _body(max_tokens=10, temperature=1.0, stream=True,
                 stream_options={"include_usage": True})
    headers = {"Idempotency-Key": "stream-retry-1"}
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            first = _events([next(line for line in r.iter_lines() if line)])
        with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            events = _events(r.iter_lines())
    assert events[0] == first[0]  # replayed from the start, same id and text
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 10
    assert len({e["id"] for e in events[:-1]}) == 1


def test_deadline_returns_partial_output_as_length(server):
    with server.client() as c:
        r = c.post("/v1/completions", json=_body(max_tokens=400), headers={"timeout": "0.6"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert 0 < r.json()["usage"]["completion_tokens"] < 400
    assert server.wait_idle()["servelm_kv_blocks_used"] == 0


def test_deadline_before_any_token_is_408(server, engine):
    # A long prompt keeps the engine busy in one big prefill step; the short request queued
    # behind it passes its 50 ms deadline before it is ever scheduled.
    long_prompt = list(range(1000, 1000 + 400))
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=_body(prompt=long_prompt, max_tokens=2,
                                                            stream=True)) as busy:
            assert busy.status_code == 200
            out = {}

            def call(stream):
                with server.client() as c2:
                    out[stream] = c2.post("/v1/completions",
                                          json=_body(max_tokens=5, stream=stream),
                                          headers={"timeout": "0.05"})

            threads = [threading.Thread(target=call, args=(s,)) for s in (False, True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            list(busy.iter_lines())
    r, s = out[False], out[True]
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    events = _events(s.text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert server.wait_idle()["servelm_kv_blocks_used"] == 0
