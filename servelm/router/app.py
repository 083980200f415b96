"""The router: an OpenAI-compatible pass-through in front of several replicas.

Owns: picking a replica per request (a policy by name over ReplicaSet.loads(); requests
with the same Idempotency-Key always go to the same replica, so its store answers a retry),
forwarding (status, headers and body unchanged; streams relayed as they come), one retry on
another replica for a request that failed before its first byte reached the client
(connection refused or reset, timeout, a 5xx), an SSE error event for a stream that breaks
mid-way (never a silent truncation), the router's own Prometheus metrics, and the fleet's
dashboard (`/dashboard`: every replica's numbers merged).
Never: parses or rewrites a response body, or retries a request twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from servelm.engine.prefix_cache import block_hashes
from servelm.server.dashboard import page_routes
from servelm.server.dashboard.data import fleet_data, parse_window
from servelm.router.policies import DEFAULT_POLICY, RouteRequest, RoutingPolicy
from servelm.router.prompts import prompt_token_ids
from servelm.router.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy recomputes.
_DROP_REQUEST = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                 "proxy-connection", "content-length"}
_DROP_RESPONSE = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                  "content-length", "content-encoding"}


@dataclass(frozen=True)
class RouterConfig:
    policy: str = DEFAULT_POLICY  # the policy's name, for the metrics and the dashboard
    request_timeout: float = 600.0
    max_body_bytes: int = 8 * 2**20
    otlp_traces_endpoint: str | None = None  # a span per request, its context passed on
    # The fleet's SLO spec (servelm/slo.py): a request's class is checked here, once for the
    # fleet, and sent to the replica as `slo_class`; None: passed through unchecked.
    slo_spec: str | None = None


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet):
        self.registry = r = CollectorRegistry()
        self.routed = Counter("servelm_router_requests_total", "Requests sent to each replica",
                              ["replica"], registry=r)
        self.retries = Counter("servelm_router_retries_total",
                               "Requests retried on another replica (before their first byte)",
                               registry=r)
        self.broken = Counter("servelm_router_broken_streams_total",
                              "Streams that broke mid-way (ended with an error event)",
                              registry=r)
        self.ejections = Counter("servelm_router_ejections_total",
                                 "Times each replica was taken out", ["replica"], registry=r)
        self.healthy = Gauge("servelm_router_replica_healthy", "1 while a replica is in",
                             ["replica"], registry=r)
        self.load = Gauge("servelm_router_replica_tokens_in_flight",
                          "Work the router has in flight per replica: uncached prompt tokens (by its "
                          "cache view) + max_tokens of each request not finished",
                          ["replica"], registry=r)
        self.imbalance = Gauge("servelm_router_imbalance_ratio",
                               "max / mean tokens in flight over healthy replicas",
                               registry=r)
        self.estimated_hits = Counter(
            "servelm_router_estimated_hit_tokens_total",
            "Prompt tokens the router expected each replica to find in its prefix cache "
            "(from the replica's KV events), for the requests it sent there",
            ["replica"], registry=r)
        self.reported_hits = Gauge(
            "servelm_router_replica_reported_hit_tokens",
            "The replica's own servelm_prefix_cache_hit_tokens_total, as last probed",
            ["replica"], registry=r)
        self.reported_prompt_tokens = Gauge(
            "servelm_router_replica_reported_prompt_tokens",
            "The replica's own servelm_prompt_tokens_total, as last probed (with the hit "
            "tokens: the replica's prefix-cache hit rate)", ["replica"], registry=r)
        self.view_blocks = Gauge("servelm_router_replica_cache_view_blocks",
                                 "Blocks in the router's view of each replica's prefix cache",
                                 ["replica"], registry=r)
        # The autoscaling signal (docs/autoscale.md): what a Kubernetes HPA or KEDA reads.
        self.signal = Gauge("servelm_router_tokens_in_flight",
                            "Work in flight on the serving replicas (uncached prompt tokens + "
                            "max_tokens of each request not finished): the autoscaling signal",
                            registry=r)
        self.signal_per_replica = Gauge(
            "servelm_router_tokens_in_flight_per_replica",
            "servelm_router_tokens_in_flight / servelm_router_replicas_serving", registry=r)
        self.serving = Gauge("servelm_router_replicas_serving",
                             "Replicas taking requests (healthy, not draining)", registry=r)
        self.draining = Gauge("servelm_router_replicas_draining",
                              "Replicas being removed: finishing their requests", registry=r)
        self.booting = Gauge("servelm_router_replicas_booting",
                             "Replicas the autoscaler started that are not ready yet", registry=r)
        self.scale_events = Counter("servelm_router_autoscale_events_total",
                                    "Autoscaler decisions carried out, by direction",
                                    ["direction"], registry=r)
        self._scale_counts = {"up": 0, "down": 0}
        self._labelled: set[str] = set()
        self.replicas = replicas
        for rep in replicas.replicas:
            self.routed.labels(rep.url)
            self.ejections.labels(rep.url)
            self.estimated_hits.labels(rep.url)

    def _render_fleet(self) -> None:
        rs = self.replicas
        serving = rs.healthy
        total = rs.tokens_in_flight()
        self.signal.set(total)
        self.signal_per_replica.set(total / len(serving) if serving else 0.0)
        self.serving.set(len(serving))
        self.draining.set(sum(r.is_draining for r in rs.replicas))
        self.booting.set(rs.num_booting)
        for direction, n in (("up", rs.num_scale_ups), ("down", rs.num_scale_downs)):
            self.scale_events.labels(direction).inc(n - self._scale_counts[direction])
            self._scale_counts[direction] = n
        urls = {rep.url for rep in rs.replicas}
        for url in self._labelled - urls:  # removed replicas: their series go
            for metric in (self.healthy, self.load, self.reported_hits,
                           self.reported_prompt_tokens, self.view_blocks):
                try:
                    metric.remove(url)
                except KeyError:
                    pass
        self._labelled = urls

    def render(self) -> bytes:
        self._render_fleet()
        loads = []
        for rep in self.replicas.replicas:
            self.healthy.labels(rep.url).set(1 if rep.is_healthy else 0)
            self.load.labels(rep.url).set(rep.tokens_in_flight)
            self.reported_hits.labels(rep.url).set(rep.reported_cached_tokens)
            self.reported_prompt_tokens.labels(rep.url).set(rep.reported_prompt_tokens)
            self.view_blocks.labels(rep.url).set(len(rep.cache_view))
            if rep.is_healthy:
                loads.append(rep.tokens_in_flight)
        mean = sum(loads) / len(loads) if loads else 0
        self.imbalance.set(max(loads) / mean if mean else 1.0)
        return generate_latest(self.registry)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": code}}, status_code=status)


def _estimate_tokens(body: dict) -> int:
    """Prompt + max_tokens of a request, for the router's load count (4 characters a token
    for text; token-id prompts counted exactly)."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = body.get("messages", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        n = len(prompt)
    else:
        n = len(json.dumps(prompt)) // 4
    out = body.get("max_tokens") or body.get("max_completion_tokens") or 256
    return n + (out if isinstance(out, int) else 256)


def _sticky(replicas: list[Replica], key: str) -> Replica:
    """Rendezvous hashing: the same key maps to the same healthy replica while it lives."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{key}|{r.url}".encode()).digest())


class Router:
    def __init__(self, replicas: ReplicaSet, policy: RoutingPolicy, config: RouterConfig,
                 tokenizer=None):
        self.replicas = replicas
        self.policy = policy
        self.tokenizer = tokenizer  # for text prompts' cache estimates (None: ids only)
        self.config = config
        self.metrics = RouterMetrics(replicas)
        replicas.on_change = lambda rep, ok: (None if ok else
                                             self.metrics.ejections.labels(rep.url).inc())
        self.client: httpx.AsyncClient | None = None
        self.tracing = None  # servelm.tracing.Tracing, when traces are configured
        self.slo = None
        if config.slo_spec is not None:
            from servelm.slo import SLOSpec

            self.slo = SLOSpec.load(config.slo_spec)
            self.by_class = Counter("servelm_router_requests_by_class_total",
                                    "Requests routed, by SLO class", ["slo_class"],
                                    registry=self.metrics.registry)

    def _slo_class(self, body: dict, raw: bytes) -> bytes | JSONResponse:
        """The body with its class named by `slo_class` (a 400 naming the field when the
        request names no class of the spec)."""
        from servelm.protocol import InvalidParameterError

        prio, name = body.get("priority"), body.get("slo_class")
        try:
            if prio is not None and (not isinstance(prio, int) or isinstance(prio, bool)):
                raise InvalidParameterError(f"priority must be an integer, got {prio!r}",
                                            param="priority")
            if name is not None and not isinstance(name, str):
                raise InvalidParameterError(f"slo_class must be a string, got {name!r}",
                                            param="slo_class")
            cls = self.slo.resolve(prio, name)
        except InvalidParameterError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": exc.param, "code": None}}, status_code=400)
        self.by_class.labels(cls.name).inc()
        if name == cls.name:
            return raw
        return json.dumps({**body, "slo_class": cls.name}).encode()

    def pick(self, route: RouteRequest, prompt: list[int] | None, salt, headers,
             exclude: Replica | None = None) -> tuple[Replica | None, int]:
        """(replica, the prompt tokens expected in its cache)."""
        healthy = [r for r in self.replicas.healthy if r is not exclude]
        if not healthy:
            return None, 0
        key = headers.get("idempotency-key")
        cached = self._cached_tokens(prompt, salt)
        if key:
            rep = _sticky(healthy, "idem:" + key)
            return rep, cached[self.replicas.replicas.index(rep)]
        loads = [r.load(c) if r is not exclude else r.load(c)._replace(is_healthy=False)
                 for r, c in zip(self.replicas.replicas, cached)]
        try:
            i = self.policy.pick(loads, route)
        except RuntimeError:
            return None, 0
        return self.replicas.replicas[i], cached[i]

    def _cached_tokens(self, prompt: list[int] | None, salt) -> list[int]:
        if not prompt:
            return [0] * len(self.replicas.replicas)
        by_size: dict[int, list[int]] = {}
        out = []
        for r in self.replicas.replicas:
            if not r.block_size:
                out.append(0)
                continue
            if r.block_size not in by_size:  # at least one token left to compute
                by_size[r.block_size] = block_hashes(prompt[:-1], r.block_size, salt)
            out.append(r.cached_tokens(by_size[r.block_size]))
        return out

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            return JSONResponse({"error": {"message": "request body too large",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "body_too_large"}}, status_code=413)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        span = None
        if self.tracing is not None:  # the replica's spans become children of the router's
            span = self.tracing.tracer.start_span(
                f"router {request.method} {path}", context=self.tracing.extract(headers),
                kind=self.tracing.trace.SpanKind.SERVER)
            headers = {k: v for k, v in headers.items()
                       if k.lower() not in ("traceparent", "tracestate")}
            headers.update(self.tracing.inject(span))
        try:
            response = await self._forward(request, path, raw, body, headers, span)
        except BaseException:
            if span is not None:
                span.end()
            raise
        if span is not None and not isinstance(response, StreamingResponse):
            span.set_attribute("http.response.status_code", response.status_code)
            span.end()
        return response

    async def _hold(self, route: RouteRequest, prompt, salt, headers, tokens: int):
        """Scaled to zero: wait for a replica (the autoscaler counts this request's tokens
        and boots one), then pick as usual; (None, 0) after hold_timeout_s."""
        reps = self.replicas
        reps.num_held += 1
        reps.held_tokens += tokens
        try:
            deadline = time.monotonic() + reps.hold_timeout_s
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                first, cached = self.pick(route, prompt, salt, headers)
                if first is not None:
                    return first, cached
            return None, 0
        finally:
            reps.num_held -= 1
            reps.held_tokens -= tokens

    async def _forward(self, request: Request, path: str, raw: bytes, body: dict, headers,
                       span) -> Response:
        if self.slo is not None and request.method == "POST" and path.endswith("completions"):
            checked = self._slo_class(body, raw)
            if isinstance(checked, JSONResponse):
                return checked
            raw = checked
        tokens = _estimate_tokens(body)
        is_stream = bool(body.get("stream"))
        prompt = None
        if request.method == "POST" and path.endswith("completions"):
            if len(raw) > 16384 and self.tokenizer is not None:
                prompt = await asyncio.to_thread(prompt_token_ids, body, path, self.tokenizer)
            else:
                prompt = prompt_token_ids(body, path, self.tokenizer)
        user = body.get("user") or request.headers.get("x-session-id")
        key = body.get("prompt_cache_key")
        route = RouteRequest(tokens, user if isinstance(user, str) else None,
                             key if isinstance(key, str) else None)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        first, cached = self.pick(route, prompt, salt, request.headers)
        if first is None and self.replicas.hold_timeout_s is not None:
            first, cached = await self._hold(route, prompt, salt, request.headers, tokens)
        if first is None:
            return _error(503, "no healthy replica", "no_replica")
        # A replica's load counts the work it was sent: the prompt tokens it must still
        # compute (its cached prefix is free) plus the tokens to generate.
        work = max(1, tokens - cached)
        replica, upstream, failure = await self._send(first, request.method, path, raw,
                                                      headers, request.url.query, work)
        if upstream is None:
            retry, cached = self.pick(route, prompt, salt, request.headers, exclude=first)
            if retry is None:
                return _error(502, f"replica {first.url} failed ({failure}) and no other "
                              "replica is healthy", "replica_failed")
            self.metrics.retries.inc()
            work = max(1, tokens - cached)
            replica, upstream, failure = await self._send(retry, request.method, path, raw,
                                                          headers, request.url.query, work)
            if upstream is None:
                return _error(502, f"two replicas failed: {failure}", "replica_failed")
        self.metrics.routed.labels(replica.url).inc()
        self.metrics.estimated_hits.labels(replica.url).inc(cached)
        replica.num_routed += 1
        out_headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _DROP_RESPONSE}
        out_headers["x-servelm-replica"] = replica.url
        if span is not None:
            span.set_attribute("servelm.replica", replica.url)
        if is_stream:
            return StreamingResponse(self._relay(replica, upstream, work, span),
                                     status_code=upstream.status_code, headers=out_headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:  # broke before the client saw a byte
            self.replicas.record_failure(replica, repr(exc))
            return _error(502, f"replica {replica.url} broke off its answer: {exc!r}",
                          "replica_failed")
        finally:
            self._done(replica, work)
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def dashboard_data(self, request: Request) -> Response:
        """The fleet's dashboard numbers: every replica's /dashboard/data (asked with the
        client's Authorization header, so the replicas' API key guards it) merged."""
        try:
            window = parse_window(request.query_params.get("window"))
        except ValueError as exc:
            return _error(400, str(exc), "invalid_window")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def one(rep: Replica):
            try:
                r = await self.client.get(f"{rep.url}/dashboard/data",
                                          params={"window": window, "values": 1},
                                          headers=headers, timeout=5.0)
            except httpx.HTTPError:
                return rep, None, None
            return rep, r.status_code, (r.json() if r.status_code == 200 else None)

        results = await asyncio.gather(*(one(rep) for rep in list(self.replicas.replicas)))
        if any(status == 401 for _, status, _ in results):
            return _error(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                          "invalid_api_key")
        data = fleet_data([(rep.url, rep.is_serving, d) for rep, _, d in results], window)
        data["router"] = {"policy": self.config.policy,
                          "replicas_serving": sum(rep.is_serving for rep, _, _ in results)}
        return JSONResponse(data, headers={"cache-control": "no-store"})

    @staticmethod
    def _done(replica: Replica, tokens: int) -> None:
        replica.tokens_in_flight -= tokens
        replica.num_in_flight -= 1

    async def _send(self, replica: Replica, method: str, path: str, raw: bytes, headers,
                    query: str, tokens: int):
        """(replica, streaming response or None, failure text). A 5xx counts as a failure
        (retried elsewhere); a 4xx is the client's and is passed through. The request counts
        in the replica's load from here until `_done`."""
        url = replica.url + path + (f"?{query}" if query else "")
        req = self.client.build_request(method, url, content=raw, headers=headers,
                                        timeout=self.config.request_timeout)
        replica.tokens_in_flight += tokens
        replica.num_in_flight += 1
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            self._done(replica, tokens)
            self.replicas.record_failure(replica, repr(exc))
            return replica, None, f"{type(exc).__name__}"
        if resp.status_code >= 500:
            self._done(replica, tokens)
            await resp.aclose()
            self.replicas.record_failure(replica, f"HTTP {resp.status_code}")
            return replica, None, f"HTTP {resp.status_code}"
        return replica, resp, ""

    async def _relay(self, replica: Replica, upstream: httpx.Response, tokens: int,
                     span=None):
        done = False
        try:
            async for chunk in upstream.aiter_raw():
                if b"data: [DONE]" in chunk:
                    done = True
                yield chunk
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            if not done:
                self.metrics.broken.inc()
                self.replicas.record_failure(replica, f"stream broke: {exc!r}")
                err = {"error": {"message": f"the replica's stream broke mid-way: {exc!r}",
                                 "type": "server_error", "param": None,
                                 "code": "replica_failed"}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            self._done(replica, tokens)
            await upstream.aclose()
            if span is not None:
                span.end()


def build_router_app(replicas: ReplicaSet, policy: RoutingPolicy,
                     config: RouterConfig | None = None, tokenizer=None,
                     tracing=None) -> FastAPI:
    """`tracing`: a servelm.tracing.Tracing (tests); else one for
    config.otlp_traces_endpoint when set. Without either, a client's traceparent header is
    passed to the replica unchanged."""
    config = config or RouterConfig()
    router = Router(replicas, policy, config, tokenizer)
    if tracing is None and config.otlp_traces_endpoint:
        from servelm.tracing import Tracing

        tracing = Tracing("servelm-router", config.otlp_traces_endpoint)
    router.tracing = tracing

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                               max_keepalive_connections=64))
        async with httpx.AsyncClient() as probe_client:
            await replicas.probe_all(probe_client)  # know who is up before the first request
        replicas.start()
        try:
            yield
        finally:
            await replicas.stop()
            await router.client.aclose()

    app = FastAPI(title="servelm router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        n = len(replicas.healthy)
        if not n and replicas.hold_timeout_s is not None:  # scaled to zero: a request wakes it
            return JSONResponse({"status": "scaled_to_zero", "healthy_replicas": 0,
                                 "replicas": len(replicas.replicas),
                                 "booting": replicas.num_booting})
        status = 200 if n else 503
        return JSONResponse({"status": "ok" if n else "no_replica", "healthy_replicas": n,
                             "replicas": len(replicas.replicas)}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    page_routes(app)  # /dashboard and its script, the same page as a replica's

    @app.get("/dashboard/data")
    async def dashboard(request: Request) -> Response:
        return await router.dashboard_data(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(path: str, request: Request) -> Response:
        return await router.forward(request, "/" + path)

    return app


__all__ = ["Router", "RouterConfig", "build_router_app"]
