"""The FastAPI app: routes, auth, error shapes, lifespan of the engine client.

Owns: ServerState (what the routes share: the engine client,
metrics, idempotency store, drain flag, in-flight count), `build_app(engine, config)`, and
the pure-ASGI middleware that checks the API key before any routing happens.
The engine client is a CoreClient (the engine core in its own process: `servelm serve`'s
default) or an AsyncEngine (an Engine on a thread of this process: tests, --engine-core
thread); both have the same event-loop API.
ServerConfig (the server flags) lives in server_config.py, importable without FastAPI.
Never: runs model code on the event loop, or answers bad input with a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import servelm
from servelm.engine.async_engine import AsyncEngine, StreamRouter
from servelm.server.errors import APIError, error_response
from servelm.server.dashboard import PUBLIC_PATHS as DASHBOARD_PUBLIC_PATHS, dashboard_router
from servelm.tracing import install_from_config as install_tracing
from servelm.server.idempotency import IdempotencyStore
from servelm.server.metrics import CostModel, ServerMetrics
from servelm.server.server_config import ServerConfig
from servelm.server.state_store import state_store_scheme
from servelm.parsers import get_reasoning_parser, get_tool_parser
from servelm.server.async_store import AsyncStore
from servelm.server.batch_runner import BatchLimits, BatchRunner
from servelm.server.batches_serving import BatchesServing
from servelm.server.files_serving import FilesServing
from servelm.server.lora_serving import LoraServing
from servelm.server.responses_serving import ResponsesServing
from servelm.server.serving import OpenAIServing
from servelm.server.tokenize_serving import TokenizeServing

logger = logging.getLogger(__name__)

# Exact, decoded paths that need no API key (the dashboard's page and script hold no data;
# the JSON they poll is guarded).
PUBLIC_PATHS = frozenset({"/health", *DASHBOARD_PUBLIC_PATHS})


@dataclass
class ServerState:
    config: ServerConfig
    async_engine: StreamRouter  # AsyncEngine or servelm.core_process.client.CoreClient
    metrics: ServerMetrics
    idempotency: IdempotencyStore
    draining: bool = False
    num_inflight: int = 0
    lora_metrics: object = None  # servelm.lora.metrics.LoraMetrics
    disagg: dict | None = None  # this worker's KV transfer role (servelm/disagg/http.py info)
    started: float = field(default_factory=time.monotonic)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait for in-flight requests up to `timeout`. True if all done."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_inflight == 0:
            return True
        # Past the grace period: abort what is left so its handlers finish now (streams end
        # with finish_reason "abort" and [DONE]) instead of being cancelled mid-write.
        self.async_engine.abort_all()
        deadline = time.monotonic() + 5.0
        while self.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return False


class AuthMiddleware:
    """Bearer-token check on the decoded path before routing, so no spelling of a path
    (`//v1/models`, `/V1/models`, `/health/../v1/models`, %-escapes) reaches a route without
    the key; only the exact paths in PUBLIC_PATHS are public (/health, and the dashboard's
    page and script, which hold no data)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope.get("path") not in PUBLIC_PATHS \
                and not self._authorized(scope):
            resp = error_response(401, "Invalid or missing API key: send 'Authorization: "
                                  "Bearer <key>'", "invalid_request_error",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, self._counting(send))
        return await self.app(scope, receive, self._counting(send))

    def _authorized(self, scope) -> bool:
        values = [v for k, v in scope.get("headers", []) if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self.api_key)

    def _counting(self, send):
        async def wrapped(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(str(message["status"])).inc()
            await send(message)
        return wrapped


def _cost_model(client: StreamRouter, config: ServerConfig) -> CostModel | None:
    """Bytes and FLOPs per step for the utilisation metrics; None for a model-free engine
    (tests' fake runner)."""
    info = getattr(client, "info", None)
    if info is None:
        engine = client.engine
        if getattr(engine, "model_config", None) is None:
            return None
        return CostModel.from_engine(engine, config.peak_bandwidth, config.peak_flops)
    return CostModel.from_config(info.model_config, dtype=info.dtype,
                                 quantization=info.quantization,
                                 kv_cache_dtype=info.kv_cache_dtype,
                                 device_type=info.device_type,
                                 peak_bandwidth=config.peak_bandwidth,
                                 peak_flops=config.peak_flops)


def build_app(engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine`: an Engine (run on a thread of this process) or an engine
    client (a CoreClient); the client starts and stops with the app's lifespan."""
    get_tool_parser(config.tool_call_parser)  # an unknown name fails here, not per request
    if config.reasoning_parser is not None:
        get_reasoning_parser(config.reasoning_parser)
    state_store_scheme(config.state_store)  # a bad --state-store URL fails here (opened lazily)
    async_engine = engine if isinstance(engine, StreamRouter) else AsyncEngine(engine)
    cost = _cost_model(async_engine, config)
    metrics = ServerMetrics(config.served_model_name, config.slo_ttft_ms / 1000,
                            config.slo_tpot_ms / 1000, cost,
                            slo_spec=config.load_slo_spec())
    metrics.start_from(async_engine.snapshot)
    async_engine.observer = metrics.observe_step
    state = ServerState(config, async_engine, metrics,
                        IdempotencyStore(config.idempotency_ttl_s, config.idempotency_max_entries))
    _observe_loras(state)
    _observe_experts(state)
    serving = OpenAIServing(state)
    tokens = TokenizeServing(serving.admission)
    loras = LoraServing(state)
    store = AsyncStore(config.state_store)
    responses = ResponsesServing(serving, store)
    files = FilesServing(store.call, config.max_file_bytes, config.tenant_quota)
    runner = _batch_runner(config, serving, responses, store, metrics)
    batches = BatchesServing(store.call, runner, config.served_model_name,
                             config.max_body_bytes, config.max_active_batches,
                             config.tenant_quota)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        batch_task = asyncio.ensure_future(runner.run())
        try:
            yield
        finally:
            await runner.stop()  # its unfinished lines run again where the batch resumes
            batch_task.cancel()
            state.draining = True
            state.idempotency.cancel_all()
            await responses.close()
            await store.close()
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="servelm", version=servelm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.servelm = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc.errors()[:1]))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "server_error",
                              code="internal_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.handle(request, "chat")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        return await responses.retrieve(response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        return await responses.list_input_items(response_id, request)

    @app.post("/v1/files")
    async def create_file(request: Request) -> Response:
        return await files.create(request)

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        return await files.list(request)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> Response:
        return await files.retrieve(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return await files.content(file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        return await files.delete(file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        return await batches.create(request)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        return await batches.list(request)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> Response:
        return await batches.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        return await batches.cancel(batch_id)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serving.handle(request, "embedding")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokens.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokens.detokenize(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [_model_card(config, async_engine, state)]
        cards += [_lora_card(config, state, name) for name in async_engine.lora_names]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id in async_engine.lora_names and model_id != config.served_model_name:
            return JSONResponse(_lora_card(config, state, model_id))
        if model_id != config.served_model_name:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(_model_card(config, async_engine, state))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await loras.load_lora_adapter(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await loras.unload_lora_adapter(request)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not async_engine.is_alive:
            body = {"status": "engine_dead"}
            cause = getattr(async_engine, "dead_cause", None)
            if cause:
                body["cause"] = cause
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.refresh(async_engine)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/kv_events")
    async def kv_events(after: int = 0, limit: int = 20000) -> JSONResponse:
        """The prefix cache's blocks stored (kind 0) and removed (kind 1), by chain hash,
        numbered from `after` (servelm router builds its view of this replica from them)."""
        events, nxt, reset = async_engine.kv_events.since(after, max(1, min(limit, 100000)))
        return JSONResponse({"block_size": async_engine.block_size, "next": nxt,
                             "reset": reset,
                             "events": [[e.kind, e.hash, e.parent] for e in events]})

    @app.get("/v1/disagg")
    async def disagg_info() -> JSONResponse:
        """This worker's part in prefill/decode disaggregation (a router reads it)."""
        return JSONResponse(state.disagg or {"role": "colocated"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": servelm.__version__})

    app.include_router(dashboard_router(state))
    install_tracing(app, state)  # --otlp-traces-endpoint; inside the API-key check
    app.add_middleware(AuthMiddleware, api_key=config.api_key, metrics=metrics)
    return app


def _batch_runner(config: ServerConfig, serving: OpenAIServing, responses: ResponsesServing,
                  store: AsyncStore, metrics: ServerMetrics) -> BatchRunner:
    """The runner of the store's batches: each endpoint's own handler per line, in the
    lowest SLO class (the highest priority number)."""
    handlers = {"/v1/chat/completions": lambda r: serving.handle(r, "chat"),
                "/v1/completions": lambda r: serving.handle(r, "completion"),
                "/v1/embeddings": lambda r: serving.handle(r, "embedding"),
                "/v1/responses": responses.create}
    lowest = max(metrics.slo_spec.classes, key=lambda c: c.priority).name
    limits = BatchLimits(max_inflight=config.batch_max_inflight,
                         max_lines=config.max_batch_lines)
    state = serving.state
    return BatchRunner(handlers, store.call, state.async_engine, lowest,
                       config.served_model_name, limits, registry=metrics.registry,
                       draining=lambda: state.draining)


def _observe_experts(state: ServerState) -> None:
    """A MoE model's expert load (servelm/server/moe_metrics.py), on the step observer."""
    from servelm.server.moe_metrics import MoeMetrics

    client = state.async_engine
    moe = MoeMetrics(state.metrics.registry)
    observe = client.observer

    def observer(report, deltas) -> None:
        observe(report, deltas)
        moe.observe_step(report)

    client.observer = observer


def _observe_loras(state: ServerState) -> None:
    """Per-adapter series beside the server's own, fed by the same step observer."""
    from servelm.lora.metrics import LoraMetrics

    client = state.async_engine
    lora = state.lora_metrics = LoraMetrics(state.metrics.registry)
    observe = client.observer

    def observer(report, deltas) -> None:
        observe(report, deltas)
        lora.observe_step(report)

    client.observer = observer


def _lora_card(config: ServerConfig, state: ServerState, name: str) -> dict:
    """A LoRA adapter as /v1/models lists it: its base model is its parent."""
    return {"id": name, "object": "model", "created": int(
        time.time() - (time.monotonic() - state.started)), "owned_by": "servelm",
        "root": name, "parent": config.served_model_name}


def _model_card(config: ServerConfig, engine: StreamRouter, state: ServerState) -> dict:
    return {"id": config.served_model_name, "object": "model", "created": int(
        time.time() - (time.monotonic() - state.started)), "owned_by": "servelm",
        "root": engine.model_name or config.served_model_name,
        "max_model_len": engine.max_model_len}
