"""The disaggregation router: each request runs its prompt on a prefill worker and continues
on a decode worker, and the client sees one ordinary OpenAI response.

Owns: `servelm router --prefill URL... --decode URL...` and `servelm serve --disagg P:D`
(P prefill and D decode `servelm serve --role ...` workers on this machine, the cores split
between them, started and stopped by the launcher's Supervisor, the router on the public
port). Per request:

    1. pick a healthy prefill and a healthy decode worker, each by a routing policy of the
       registry (servelm/router/policies.py; WORKER_POLICY, least_busy, unless told)
    2. POST the request to the prefill worker as a one-token stream (max_tokens 1, n 1)
       with x-servelm-kv-transfer {transfer_id, role prefill}; wait for its status only
    3. POST the client's request unchanged to the decode worker with {transfer_id, role
       decode, source: the prefill worker's KV address}: it pulls the blocks while the
       prefill worker is still computing them, then decodes
    4. relay the decode worker's response (stream or body) to the client

A prefill worker that refuses or fails (no answer, 429, 5xx) costs no correctness: the decode
request goes without the header and its worker computes the prompt itself (counted as a
fallback). A decode worker that fails before its first byte is retried once on another
(without a transfer: the prefill copy may be gone); one that breaks mid-stream ends the
stream with an error event, never a silent truncation.
Never: parses a response body, runs model code, or sends a request to a worker of the wrong
role (each worker's role is read from its GET /v1/disagg).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

from servelm.disagg.http import HEADER, header_value
from servelm.launch import ProcessSpec, Supervisor
from servelm.router.app import _DROP_RESPONSE, _error
from servelm.router.app import _DROP_REQUEST as _DROP_PROXY
from servelm.router.policies import WORKER_POLICY, RouteRequest, make_policy
from servelm.router.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)

_DROP_REQUEST = _DROP_PROXY | {HEADER}  # only the router sets a transfer header
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


class DisaggMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("servelm_disagg_router_requests_total",
                                "Requests routed prefill -> decode", registry=r)
        self.fallbacks = Counter("servelm_disagg_router_fallbacks_total",
                                 "Requests sent to a decode worker without a transfer, by why",
                                 ["cause"], registry=r)
        self.broken = Counter("servelm_disagg_router_broken_streams_total",
                              "Decode streams that broke mid-way", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill worker runs it: its prompt, one token, one
    choice, streamed (so its status comes back at admission, not after the prompt)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "n", "best_of",
                                                      "logprobs", "top_logprobs", "echo",
                                                      "min_tokens")}
    out.update(stream=True, max_tokens=1, n=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class DisaggRouter:
    def __init__(self, prefill: ReplicaSet, decode: ReplicaSet, request_timeout: float = 600.0,
                 policy: str = WORKER_POLICY):
        self.prefill = prefill
        self.decode = decode
        # One policy object per role: a stateful one (round robin's cursor) turns per role.
        self.prefill_policy = make_policy(policy)
        self.decode_policy = make_policy(policy)
        self.request_timeout = request_timeout
        self.metrics = DisaggMetrics()
        self.client: httpx.AsyncClient | None = None
        self.kv_addresses: dict[str, str] = {}  # prefill URL -> its KV address
        self._drains: set[asyncio.Task] = set()

    async def check_roles(self) -> None:
        """Read each worker's role; a worker of the wrong role is an error at start-up."""
        for reps, role in ((self.prefill, "prefill"), (self.decode, "decode")):
            for rep in reps.replicas:
                info = (await self.client.get(rep.url + "/v1/disagg", timeout=10.0)).json()
                if info.get("role") != role:
                    raise RuntimeError(f"{rep.url} runs the {info.get('role')!r} role, not "
                                       f"{role} (start it with --role {role})")
                if role == "prefill":
                    self.kv_addresses[rep.url] = info["kv_address"]

    def pick(self, reps: ReplicaSet, route: RouteRequest,
             exclude: Replica | None = None) -> Replica | None:
        """A worker of `reps` (the prefill or the decode set) by that role's policy; None
        when none is serving. exclude: a worker that just failed this request."""
        policy = self.prefill_policy if reps is self.prefill else self.decode_policy
        loads = [r.load()._replace(is_healthy=r.is_serving and r is not exclude)
                 for r in reps.replicas]
        try:
            return reps.replicas[policy.pick(loads, route)]
        except RuntimeError:  # no healthy worker
            return None

    async def generate(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return _error(400, "the request body must be a JSON object", "invalid_request")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        route = _route_request(body, headers)
        decode = self.pick(self.decode, route)
        if decode is None:
            return _error(503, "no healthy decode worker", "no_replica")
        self.metrics.requests.inc()
        kv_header = await self._start_prefill(path, body, headers, route)
        for attempt in range(2):
            hdrs = dict(headers)
            if kv_header is not None:
                hdrs[HEADER] = kv_header
            resp, why = await self._send(decode, path, raw, hdrs)
            if resp is not None:
                return await self._respond(decode, resp, bool(body.get("stream")))
            nxt = self.pick(self.decode, route, exclude=decode)
            if attempt == 1 or nxt is None:
                return _error(502, f"the decode worker failed: {why}", "replica_failed")
            decode, kv_header = nxt, None  # the retry computes the prompt itself
            self.metrics.fallbacks.labels("decode_retry").inc()
        raise AssertionError("unreachable")

    async def _start_prefill(self, path: str, body: dict, headers: dict,
                             route: RouteRequest) -> str | None:
        """Start the prompt on a prefill worker; the decode worker's header, or None when
        no prefill worker took it (the decode worker computes the prompt then)."""
        prefill = self.pick(self.prefill, route)
        if prefill is None:
            self.metrics.fallbacks.labels("no_prefill").inc()
            return None
        tid = uuid.uuid4().hex
        hdrs = {**headers, HEADER: header_value(tid, "prefill")}
        resp, why = await self._send(prefill, path, json.dumps(prefill_body(body)).encode(),
                                     hdrs)
        if resp is None or resp.status_code != 200:
            cause = "prefill_refused" if resp is not None else "prefill_failed"
            if resp is not None:
                await self._close(prefill, resp)
            self.metrics.fallbacks.labels(cause).inc()
            return None
        task = asyncio.create_task(self._drain(prefill, resp))  # its one token is not used
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return header_value(tid, "decode", self.kv_addresses[prefill.url])

    async def _send(self, rep: Replica, path: str, raw: bytes, headers):
        req = self.client.build_request("POST", rep.url + path, content=raw, headers=headers,
                                        timeout=self.request_timeout)
        rep.num_in_flight += 1
        rep.num_routed += 1
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            rep.num_in_flight -= 1
            self._reps(rep).record_failure(rep, repr(exc))
            return None, type(exc).__name__
        if resp.status_code >= 500:
            await self._close(rep, resp)
            self._reps(rep).record_failure(rep, f"HTTP {resp.status_code}")
            return None, f"HTTP {resp.status_code}"
        return resp, ""

    def _reps(self, rep: Replica) -> ReplicaSet:
        return self.prefill if rep in self.prefill.replicas else self.decode

    async def _close(self, rep: Replica, resp: httpx.Response) -> None:
        rep.num_in_flight -= 1
        await resp.aclose()

    async def _drain(self, rep: Replica, resp: httpx.Response) -> None:
        try:
            async for _ in resp.aiter_raw():
                pass
        except httpx.HTTPError as exc:
            logger.warning("prefill stream from %s broke: %r", rep.url, exc)
        finally:
            await self._close(rep, resp)

    async def _respond(self, rep: Replica, resp: httpx.Response, stream: bool) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        if not stream or resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await self._close(rep, resp)
            return Response(content, resp.status_code, headers)
        return StreamingResponse(self._relay(rep, resp), resp.status_code, headers)

    async def _relay(self, rep: Replica, resp: httpx.Response):
        done = False
        try:
            async for chunk in resp.aiter_raw():
                if b"data: [DONE]" in chunk:
                    done = True
                yield chunk
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            if not done:
                self.metrics.broken.inc()
                self.decode.record_failure(rep, f"stream broke: {exc!r}")
                err = {"error": {"message": f"the decode worker's stream broke mid-way: "
                                            f"{exc!r}", "type": "server_error", "param": None,
                                 "code": "replica_failed"}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await self._close(rep, resp)

    async def passthrough(self, request: Request, path: str) -> Response:
        """Anything else (models, tokenize, ...) goes to a decode worker as it is."""
        rep = self.pick(self.decode, RouteRequest())
        if rep is None:
            return _error(503, "no healthy decode worker", "no_replica")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        url = rep.url + path + (f"?{request.url.query}" if request.url.query else "")
        try:
            resp = await self.client.request(request.method, url, content=await request.body(),
                                             headers=headers, timeout=self.request_timeout)
        except httpx.HTTPError as exc:
            return _error(502, f"the decode worker failed: {exc!r}", "replica_failed")
        return Response(resp.content, resp.status_code,
                        {k: v for k, v in resp.headers.items()
                         if k.lower() not in _DROP_RESPONSE})


def _route_request(body: dict, headers: dict) -> RouteRequest:
    """What a policy may read of a request here: its session and cache keys (the router
    counts no tokens, so a policy reading them sees none)."""
    user = body.get("user") or headers.get("x-session-id")
    key = body.get("prompt_cache_key")
    return RouteRequest(0, user if isinstance(user, str) else None,
                        key if isinstance(key, str) else None)


def build_disagg_app(prefill_urls: list[str], decode_urls: list[str],
                     probe_interval: float = 1.0, request_timeout: float = 600.0,
                     policy: str = WORKER_POLICY) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("the disaggregation router needs --prefill and --decode workers")
    router = DisaggRouter(ReplicaSet(prefill_urls, probe_interval),
                          ReplicaSet(decode_urls, probe_interval), request_timeout, policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                               max_keepalive_connections=64))
        async with httpx.AsyncClient() as probe:
            await router.prefill.probe_all(probe)
            await router.decode.probe_all(probe)
        await router.check_roles()
        router.prefill.start()
        router.decode.start()
        try:
            yield
        finally:
            await router.prefill.stop()
            await router.decode.stop()
            await router.client.aclose()

    app = FastAPI(title="servelm disaggregation router", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        ok = bool(router.prefill.healthy) and bool(router.decode.healthy)
        return JSONResponse({"status": "ok" if ok else "no_replica",
                             "prefill": len(router.prefill.healthy),
                             "decode": len(router.decode.healthy)},
                            status_code=200 if router.decode.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request) -> Response:
        path = "/" + path
        if request.method == "POST" and path in GENERATE_PATHS:
            return await router.generate(request, path)
        return await router.passthrough(request, path)

    return app


# -- servelm serve --disagg P:D ---------------------------------------------------------------

def parse_disagg(spec: str) -> tuple[int, int]:
    p, sep, d = spec.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise ValueError(f"--disagg is P:D with P, D >= 1 (prefill and decode workers), got "
                         f"{spec!r}")
    return int(p), int(d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_specs(args, num_prefill: int, num_decode: int,
                 transport: str) -> tuple[list[ProcessSpec], list[str], list[str]]:
    """(the workers `serve --disagg` starts, prefill URLs, decode URLs): each the parent's
    options with its role and KV transport (a prefill worker's KV address its own)."""
    import tempfile

    from servelm.router.data_parallel import replica_options, replica_spec

    threads = max(1, (os.cpu_count() or 1) // (num_prefill + num_decode))
    drop = ("disagg", "disagg_role", "kv_address", "kv_transport")
    specs, prefill, decode = [], [], []
    for role, n, urls in (("prefill", num_prefill, prefill), ("decode", num_decode, decode)):
        for _ in range(n):
            port = _free_port()
            changes = {"disagg_role": role, "kv_transport": transport}
            if role == "prefill":
                shm_path = os.path.join(tempfile.gettempdir(), f"servelm-kv-{port}.sock")
                changes["kv_address"] = (f"tcp://127.0.0.1:{_free_port()}"
                                         if transport == "tcp" else f"shm://{shm_path}")
            options = replica_options(args, port, threads, drop, **changes)
            specs.append(replica_spec(options, f"{role} worker"))
            urls.append(f"http://127.0.0.1:{port}")
    return specs, prefill, decode


def serve_disagg(args) -> int:
    import uvicorn

    from servelm.router.cli import RouterServer
    from servelm.router.data_parallel import bind_socket, report_deaths

    try:
        num_prefill, num_decode = parse_disagg(args.disagg)
    except ValueError as exc:
        print(f"[servelm] {exc}", file=sys.stderr, flush=True)
        return 2
    sock = bind_socket(args.host, args.port)
    specs, prefill, decode = worker_specs(args, num_prefill, num_decode, args.kv_transport)
    supervisor, watch = Supervisor(), None
    try:
        supervisor.start_all(specs)
        watch = report_deaths(supervisor, "disaggregation")
        app = build_disagg_app(prefill, decode, probe_interval=0.5)
        host, port = sock.getsockname()[:2]
        print(f"[servelm] serving {args.served_model_name or args.model} at "
              f"http://{host}:{port}/v1 (disaggregated: {num_prefill} prefill, {num_decode} "
              f"decode, KV over {args.kv_transport})", file=sys.stderr, flush=True)
        RouterServer(uvicorn.Config(app, log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=5)).run(sockets=[sock])
    except RuntimeError as exc:  # LaunchError among them
        print(f"[servelm] disaggregation: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if watch is not None:
            watch.stop()
        supervisor.stop_all(args.drain_timeout + 5)
    return 0


__all__ = ["DisaggRouter", "build_disagg_app", "parse_disagg", "prefill_body", "serve_disagg",
           "worker_specs"]
