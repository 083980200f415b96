"""The disaggregation router against scripted workers (no model): what each worker is sent,
a decode worker failing before its first byte (retried elsewhere without a transfer), one
breaking mid-stream (an error event, never a silent truncation), a refused prefill (the
decode worker computes the prompt), workers of the wrong role refused at start-up."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.disagg.http import HEADER
from servelm.router.disagg import build_disagg_app
from tests.router.test_router import _Uvicorn, _port


def _chunk(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode()


def worker(role: str, behaviour: str = "ok", seen: list | None = None) -> _Uvicorn:
    app = FastAPI()
    seen = seen if seen is not None else []

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/v1/disagg")
    async def disagg():
        return JSONResponse({"role": role, "kv_address": "tcp://127.0.0.1:9"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append((json.loads(request.headers.get(HEADER, "null")), body))
        if behaviour == "503":
            return JSONResponse({"error": {"message": "down"}}, status_code=503)
        if behaviour == "429":
            return JSONResponse({"error": {"message": "full"}}, status_code=429)

        async def stream():
            yield _chunk("a")
            yield _chunk("b")
            if behaviour == "break":
                await asyncio.sleep(0.05)
                raise RuntimeError("worker died mid-stream")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    server = _Uvicorn(app, _port())
    server.seen = seen
    return server


def _router(prefill, decode) -> _Uvicorn:
    return _Uvicorn(build_disagg_app([p.url for p in prefill], [d.url for d in decode],
                                     probe_interval=5.0), _port())


def _stream(url: str) -> list[str]:
    lines = []
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "n": 2,
                            "stream": True, "logprobs": 1}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
    return lines


def _stop(*servers):
    for s in servers:
        s.stop()


def test_prefill_then_decode_with_one_transfer():
    p, d = worker("prefill"), worker("decode")
    router = _router([p], [d])
    try:
        lines = _stream(router.url)
        assert lines[-1] == "[DONE]" and len(lines) == 3
        (p_kv, p_body), = p.seen
        (d_kv, d_body), = d.seen
        assert p_kv["role"] == "prefill" and d_kv["role"] == "decode"
        assert p_kv["transfer_id"] == d_kv["transfer_id"]
        assert d_kv["source"] == "tcp://127.0.0.1:9"
        assert p_body["max_tokens"] == 1 and p_body["n"] == 1 and "logprobs" not in p_body
        assert d_body["n"] == 2 and d_body["max_tokens"] == 5  # the client's, unchanged
    finally:
        _stop(router, p, d)


def test_decode_failing_before_its_first_byte_is_retried_without_a_transfer():
    p, bad, good = worker("prefill"), worker("decode", "503"), worker("decode")
    router = _router([p], [bad, good])
    try:
        for _ in range(2):  # whichever decode worker is picked first
            assert _stream(router.url)[-1] == "[DONE]"
        retried = [kv for kv, _ in good.seen if kv is None]
        assert bad.seen and len(retried) == len(bad.seen)
    finally:
        _stop(router, p, bad, good)


def test_decode_breaking_mid_stream_ends_with_an_error_event():
    p, d = worker("prefill"), worker("decode", "break")
    router = _router([p], [d])
    try:
        lines = _stream(router.url)
        assert json.loads(lines[-2])["error"]["code"] == "replica_failed"
        assert lines[-1] == "[DONE]"
    finally:
        _stop(router, p, d)


def test_a_refused_prefill_sends_the_request_without_a_transfer():
    p, d = worker("prefill", "429"), worker("decode")
    router = _router([p], [d])
    try:
        assert _stream(router.url)[-1] == "[DONE]"
        assert d.seen[0][0] is None
    finally:
        _stop(router, p, d)


def test_workers_of_the_wrong_role_are_refused():
    a, b = worker("decode"), worker("decode")
    app = build_disagg_app([a.url], [b.url])
    try:
        async def start():
            async with app.router.lifespan_context(app):
                pass
        with pytest.raises(RuntimeError, match="--role prefill"):
            asyncio.run(start())
    finally:
        _stop(a, b)


def _disagg_router(policy: str | None = None):
    from servelm.router.disagg import DisaggRouter
    from servelm.router.replicas import ReplicaSet

    sets = (ReplicaSet(["http://p0", "http://p1"]), ReplicaSet(["http://d0", "http://d1"]))
    return DisaggRouter(*sets) if policy is None else DisaggRouter(*sets, policy=policy)


def test_workers_are_picked_by_the_registrys_worker_policy():
    from servelm.router.policies import RouteRequest

    router = _disagg_router()
    assert router.prefill_policy.name == router.decode_policy.name == "least_busy"
    p0, p1 = router.prefill.replicas
    p0.num_in_flight, p1.num_routed = 1, 5
    assert router.pick(router.prefill, RouteRequest()) is p1  # fewest in flight
    p0.num_in_flight = 0
    assert router.pick(router.prefill, RouteRequest()) is p0  # then fewest routed
    assert router.pick(router.prefill, RouteRequest(), exclude=p0) is p1
    p1.is_healthy = False
    assert router.pick(router.prefill, RouteRequest(), exclude=p0) is None


def test_a_registered_policy_changes_the_disagg_pick(monkeypatch):
    from servelm.router import policies
    from servelm.router.policies import RouteRequest

    class LastHealthy:
        name = "last_healthy"
        summary = "the healthy replica listed last"

        def pick(self, loads, request):
            return max(i for i, load in enumerate(loads) if load.is_healthy)

    monkeypatch.setitem(policies._POLICIES, LastHealthy.name, LastHealthy)
    default, chosen = _disagg_router(), _disagg_router("last_healthy")
    for router in (default, chosen):
        router.decode.replicas[1].num_in_flight = 3  # busier, so least_busy avoids it
    assert default.pick(default.decode, RouteRequest()).url == "http://d0"
    assert chosen.pick(chosen.decode, RouteRequest()).url == "http://d1"
    assert chosen.pick(chosen.prefill, RouteRequest()).url == "http://p1"
    with pytest.raises(ValueError, match="routing policy 'nope'"):
        _disagg_router("nope")


def test_the_disagg_router_sends_a_session_to_one_prefill_worker():
    p0, p1, d = worker("prefill"), worker("prefill"), worker("decode")
    plain = _router([p0, p1], [d])
    try:
        for _ in range(4):  # least_busy, one request at a time: the workers take turns
            assert _stream(plain.url)[-1] == "[DONE]"
        assert len(p0.seen) == len(p1.seen) == 2
    finally:
        _stop(plain)
    sticky = _Uvicorn(build_disagg_app([p0.url, p1.url], [d.url], probe_interval=5.0,
                                       policy="session"), _port())
    try:
        for _ in range(4):
            with httpx.stream("POST", sticky.url + "/v1/completions", timeout=30,
                              json={"model": "m", "prompt": [1], "max_tokens": 2,
                                    "stream": True, "user": "alice"}) as r:
                assert r.status_code == 200
                r.read()
        assert sorted((len(p0.seen), len(p1.seen))) == [2, 6]  # all four on one worker
    finally:
        _stop(sticky, p0, p1, d)
