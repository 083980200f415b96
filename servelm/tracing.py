"""OpenTelemetry traces of requests: off by default, OTLP/HTTP when configured.

Owns: `install(app, recorder, endpoint=..., exporter=...)`: a pure-ASGI middleware that opens
one SERVER span per API request (its parent taken from the W3C `traceparent` header, so a
trace crosses the router), and, when the request's records are complete, its child spans
built from them with their measured instants: `host` (parse, template, tokenize), `queue`,
`prefill` with one `prefill step` per engine step before the first token (the chunks of its
prompt, and whatever else those steps computed), `decode`, and `stream` (writing to the
client, with the time writes waited on its socket). Also `inject_headers` / `router_span`
for the router, which opens its own span and passes its context on.
Never: imports OpenTelemetry unless tracing is configured (the `servelm[otel]` extra), or
touches the engine: the spans come from the front end's records, after the fact.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

_PATH_PREFIXES = ("/v1/",)
_ROOT: contextvars.ContextVar[Any] = contextvars.ContextVar("servelm_trace_root", default=None)


def _otel():
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SimpleSpanProcessor,
        )
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )
    except ImportError as exc:
        raise ValueError("otlp_traces_endpoint: tracing needs OpenTelemetry: pip install "
                         "'servelm[otel]'") from exc
    return trace, Resource, TracerProvider, BatchSpanProcessor, SimpleSpanProcessor, \
        TraceContextTextMapPropagator


def _ns(monotonic_s: float, now_mono: float, now_unix: float) -> int:
    return int((now_unix - (now_mono - monotonic_s)) * 1e9)


class Tracing:
    """A tracer of its own (never the process-global provider), exporting to `exporter` or to
    an OTLP/HTTP endpoint."""

    def __init__(self, service_name: str, endpoint: str | None = None, exporter=None):
        trace, Resource, TracerProvider, Batch, Simple, Propagator = _otel()
        if exporter is None:
            if not endpoint or not endpoint.startswith(("http://", "https://")):
                raise ValueError("otlp_traces_endpoint must be an http(s) URL such as "
                                 f"http://127.0.0.1:4318/v1/traces, got {endpoint!r}")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
            processor = Batch(OTLPSpanExporter(endpoint=endpoint))
        else:
            processor = Simple(exporter)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("servelm")
        self.trace = trace
        self.propagator = Propagator()

    def extract(self, headers: dict[str, str]):
        return self.propagator.extract(headers)

    def inject(self, span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        self.provider.shutdown()

    # -- a finished request's spans, from its record -----------------------------------

    def record_spans(self, rec, steps) -> None:
        root = _ROOT.get()
        if root is None:
            return
        span, _ = root
        ctx = self.trace.set_span_in_context(span)
        now_mono, now_unix = time.monotonic(), time.time()
        t = lambda s: _ns(s, now_mono, now_unix)
        span.set_attribute("servelm.request_id", rec.request_id)
        a = rec.arrival
        marks = {"host": (a, a + (rec.host_s or 0.0))}
        submitted = a + (rec.host_s or 0.0)
        if rec.queue_s is not None:
            scheduled = submitted + rec.queue_s
            marks["queue"] = (submitted, scheduled)
            if rec.ttft_s is not None:
                marks["prefill"] = (scheduled, a + rec.ttft_s)
        if rec.ttft_s is not None and rec.e2e_s is not None:
            marks["decode"] = (a + rec.ttft_s, a + rec.e2e_s)
        if rec.stream and rec.latency_s is not None:
            marks["stream"] = (a + (rec.ttft_s or 0.0), a + rec.latency_s)
        attrs = {
            "host": {"servelm.gc_s": rec.gc_s},
            "queue": {"servelm.num_waiting_at_arrival": rec.num_waiting_at_arrival,
                      "servelm.queue_kv_full_s": rec.queue_kv_full_s},
            "prefill": {"servelm.num_prompt_tokens": rec.num_prompt_tokens,
                        "servelm.num_cached_tokens": rec.num_cached_tokens,
                        "servelm.num_preemptions": rec.num_preemptions,
                        "servelm.max_chunk_waited": rec.max_chunk_waited},
            "decode": {"servelm.num_output_tokens": rec.num_output_tokens},
            "stream": {"servelm.client_blocked_s": rec.client_blocked_s},
        }
        for name, (start, end) in marks.items():
            child = self.tracer.start_span(name, context=ctx, start_time=t(start))
            for k, v in attrs[name].items():
                child.set_attribute(k, v)
            if name == "prefill":
                pctx = self.trace.set_span_in_context(child)
                for s in steps:
                    if s.end <= start or s.start >= end:
                        continue
                    step = self.tracer.start_span("prefill step", context=pctx,
                                                  start_time=t(max(s.start, start)))
                    step.set_attribute("servelm.step.num_tokens", s.num_tokens)
                    step.set_attribute("servelm.step.max_chunk", s.max_chunk)
                    step.set_attribute("servelm.step.num_seqs", s.num_seqs)
                    step.end(end_time=t(min(s.end, end)))
            child.end(end_time=t(max(start, end)))
        return


class TracingMiddleware:
    """One SERVER span per API request, parented by its `traceparent`."""

    def __init__(self, app, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(_PATH_PREFIXES):
            return await self.app(scope, receive, send)
        tracing = self.tracing
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        span = tracing.tracer.start_span(
            f"{scope.get('method', 'GET')} {scope['path']}",
            context=tracing.extract(headers), kind=tracing.trace.SpanKind.SERVER,
            attributes={"http.request.method": scope.get("method", ""),
                        "url.path": scope["path"]})
        token = _ROOT.set((span, headers))
        status = {}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _ROOT.reset(token)
            span.end()


def current_trace_id() -> str | None:
    """The trace id (32 hex digits) of the request being served in this context, if traced."""
    root = _ROOT.get()
    if root is None:
        return None
    return f"{root[0].get_span_context().trace_id:032x}"


def install_from_config(app, state) -> Tracing | None:
    """`servelm serve --otlp-traces-endpoint URL`: trace the app (state: its ServerState)."""
    endpoint = getattr(state.config, "otlp_traces_endpoint", None)
    if not endpoint:
        return None
    return install(app, state.metrics.recorder, state.config.served_model_name,
                   endpoint=endpoint)


def install(app, recorder, service_name: str, *, endpoint: str | None = None,
            exporter=None) -> Tracing:
    """Trace the app's API requests: its middleware, and the recorder's finished records
    turned into child spans. Call before the app starts serving."""
    tracing = Tracing(service_name, endpoint, exporter)
    app.add_middleware(TracingMiddleware, tracing=tracing)
    recorder.listeners.append(lambda rec: tracing.record_spans(
        rec, recorder.steps_between(rec.arrival, rec.arrival + (rec.ttft_s or 0.0))))
    recorder.trace_id = current_trace_id
    return tracing


__all__ = ["Tracing", "TracingMiddleware", "current_trace_id", "install", "install_from_config"]
