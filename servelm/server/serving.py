"""The completion, chat and embedding endpoints: a request run from admission to its answer.

Owns: each request's path through the server (admitted and prepared by admission.py, run as
one Generation, answered as one JSON body or a stream), the formatter its kind gets, the
SLO class each engine request carries, the disconnect of a non-streamed request (abort at
once), Idempotency-Key attach/replay, and the one structured log line per request (with its
metrics). The jobs it delegates, one module each: admission.py (admit, validate, prepare),
prompts.py (token ids), generation.py (one request's engine requests), streaming.py (chunks
and SSE events), tokenize_serving.py and lora_serving.py (the other routes).
Never: calls the Engine directly (only through AsyncEngine), or blocks the event loop on
model work (long prompts are tokenized in a worker thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.disagg.http import kv_transfer_from_headers, per_prompt
from servelm.engine.async_engine import EngineDeadError
from servelm.parsers import get_reasoning_parser
from servelm.protocol import InvalidParameterError
from servelm.server.admission import Admission, Prepared
from servelm.server.errors import APIError, read_json_object
from servelm.server.formatting import (ChatFormatter, ChatOutput, CompletionFormatter,
                                       EmbeddingFormatter, Formatter, num_reasoning_tokens)
from servelm.server.generation import ClientGone, Generation, best_of
from servelm.server.idempotency import IdempotencyEntry, fingerprint
from servelm.server.prompts import Prompts, tool_parser
from servelm.server.schemas import ChatCompletionRequest
from servelm.server.sse import SSEResponse
from servelm.server.streaming import sse_events, until_ready_or_disconnect, wait_disconnect

request_logger = logging.getLogger("servelm.requests")


class OpenAIServing:
    def __init__(self, state):
        self.state = state  # ServerState (app.py)
        self.prompts = Prompts(state)
        self.admission = Admission(state, self.prompts)

    @property
    def config(self):
        return self.state.config

    @property
    def tokenizer(self):
        return self.state.async_engine.tokenizer

    async def handle(self, request: Request, kind: str) -> Response:
        arrival = time.monotonic()
        state = self.state
        state.num_inflight += 1
        handed_off = False
        try:
            self.admission.check()
            body = await read_json_object(request, self.config.max_body_bytes)
            prepared = await self.admission.prepare(kind, body, request, arrival)
            prepared.kv_transfer = _kv_transfer(request)  # a disaggregation router's header
            key = request.headers.get("idempotency-key")
            if key is not None:
                return await self._idempotent(request, prepared, key)
            if prepared.request.stream:
                response = await self._start_stream(prepared)
                handed_off = True  # the SSE response decrements num_inflight when done
                return response
            return await self._complete(request, prepared)
        except APIError as exc:
            self.admission.count_rejection(exc)
            return exc.response()
        finally:
            if not handed_off:
                state.num_inflight -= 1

    def _chat_output(self, req: ChatCompletionRequest) -> ChatOutput:
        mode, _ = req.tool_mode()
        reasoning = (get_reasoning_parser(self.config.reasoning_parser)
                     if self.config.reasoning_parser else None)
        if mode == "none":
            return ChatOutput(reasoning_parser=reasoning)
        return ChatOutput(tool_parser(self.config.tool_call_parser, mode), reasoning,
                          max_calls=None if req.parallel_tool_calls else 1,
                          tool_finish_reason="stop" if mode == "named" else "tool_calls")

    # -- running ---------------------------------------------------------------------------

    def _attach_slo(self, gen: Generation, req, forced: str | None = None) -> None:
        """Each engine request carries its SLO class's targets (the slo scheduling policy
        reads them; the goodput gauges count it in its class); `forced`: the server's
        choice (Prepared.slo_class), over the body's."""
        metrics = self.state.metrics
        try:  # embeddings name no class (their schema has no such fields): the default one
            cls = metrics.slo_spec.get(forced) if forced is not None else \
                metrics.slo_spec.resolve(getattr(req, "priority", None),
                                         getattr(req, "slo_class", None))
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        for r in gen.requests:
            r.slo = cls.request_slo()
            metrics.request_classes[r.request_id] = cls.name

    async def start(self, gen: Generation) -> None:
        """Submit; a request refused or cancelled before admission gets no delta, so its
        SLO class entry (_attach_slo) is dropped here rather than kept forever."""
        try:
            await gen.start()
        except BaseException:
            for r in gen.requests:
                self.state.metrics.request_classes.pop(r.request_id, None)
            raise

    def generation(self, p: Prepared) -> tuple[Generation, Formatter]:
        prefix = {"completion": "cmpl", "chat": "chatcmpl", "embedding": "embd"}[p.kind]
        base_id = f"{prefix}-{uuid.uuid4().hex}"
        gen = Generation(self.state.async_engine, base_id, p.prompts, p.params, p.arrival,
                         p.timeout_s, p.request.client_param, p.lora_name, p.images)
        self._attach_slo(gen, p.request, p.slo_class)
        if p.kv_transfer is not None:  # one transfer per prompt (servelm/disagg/http.py)
            for i, r in enumerate(gen.requests):
                r.kv_transfer = per_prompt(p.kv_transfer, i)
        name = p.lora_name or self.config.served_model_name
        if p.kind == "completion":
            fmt: Formatter = CompletionFormatter(
                self.tokenizer, base_id, name, gen.num_choices, p.request.echo, p.prompts,
                echo_logprobs=p.request.logprobs is not None)
        elif p.kind == "embedding":
            fmt = EmbeddingFormatter(self.tokenizer, base_id, name, gen.num_choices,
                                     p.request.encoding_format)
        else:
            fmt = ChatFormatter(self.tokenizer, base_id, name, gen.num_choices,
                                p.request.logprobs, self._chat_output(p.request))
            if fmt.output.reasoning_parser is not None:
                parser = fmt.output.reasoning_parser
                gen.count_reasoning = lambda ids: num_reasoning_tokens(self.tokenizer, ids,
                                                                       parser)
        return gen, fmt

    async def _collect(self, gen: Generation, fmt: Formatter, p: Prepared) -> JSONResponse:
        """Run to the end; the full response (or 408 when the deadline left nothing)."""
        await self.start(gen)
        try:
            while True:
                deltas = await gen.stream.get()
                if not deltas:
                    break
                for d in deltas:
                    gen.apply(d)
        except EngineDeadError as exc:
            gen.close("engine_dead")
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None
        finally:
            gen.close("finished")
        if gen.deadline_hit and gen.num_completion_tokens == 0:
            gen.status = "timeout"
            self.log(gen, p)
            raise gen.timeout_error()
        timing = gen.timing_summary()
        self.log(gen, p)
        if p.kind == "embedding" and gen.choices:
            try:
                p.request.check_dimensions(len(gen.choices[0].embedding or []))
            except InvalidParameterError as exc:
                raise APIError.from_invalid(exc) from None
        usage = gen.usage()  # best_of: every candidate's tokens count, as OpenAI bills them
        choices = gen.choices
        if p.request.num_candidates > p.request.n:
            choices = best_of(choices, p.request.num_candidates, p.request.n,
                              keep_logprobs=p.request.logprobs is not None)
        body = fmt.response(choices, p.prompt_texts, usage)
        return JSONResponse(body, headers={"x-servelm-timing": _header_json(timing)})

    async def _complete(self, request: Request, p: Prepared) -> Response:
        gen, fmt = self.generation(p)
        task = asyncio.ensure_future(self._collect(gen, fmt, p))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            gen.cancel("disconnect")
            gen.status = "client_disconnected"
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ClientGone, APIError):
                pass
            self.log(gen, p)
            return Response(status_code=499)  # nobody reads it
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                gen.close("cancelled")

    async def _start_stream(self, p: Prepared) -> SSEResponse:
        gen, fmt = self.generation(p)
        await self.start(gen)  # 4xx before any byte of the stream is sent
        state = self.state

        def on_close() -> None:
            gen.close("finished")
            state.num_inflight -= 1
            self.log(gen, p)

        def on_disconnect(why: str) -> None:
            gen.status = "client_disconnected" if why == "disconnect" else "write_timeout"
            gen.cancel(why)

        return SSEResponse(sse_events(gen, fmt, p), write_timeout=self.config.write_timeout,
                           on_disconnect=on_disconnect, on_close=on_close)

    # -- Idempotency-Key -------------------------------------------------------------------

    async def _idempotent(self, request: Request, p: Prepared, key: str) -> Response:
        store = self.state.idempotency
        route = p.kind
        fp = fingerprint(route, p.body)
        entry = store.lookup(route, key, fp)
        if entry is None:
            entry = store.start(route, key, fp, lambda e: self._produce(e, p))
        else:
            self.state.metrics.idempotent_replays.inc()
        try:
            await until_ready_or_disconnect(entry.ready, request)
        except ClientGone:
            return Response(status_code=499)
        if p.request.stream:
            # Replays every event so far, then follows live; a reader leaving does not abort
            # the generation (a retry is expected to come back for it).
            return SSEResponse(entry.follow(), write_timeout=self.config.write_timeout,
                               on_disconnect=lambda why: None)
        status, body, headers = entry.result
        return Response(body, status_code=status, media_type="application/json",
                        headers=headers)

    async def _produce(self, entry: IdempotencyEntry, p: Prepared) -> None:
        """Runs the generation for an Idempotency-Key, whoever is (or is not) listening."""
        self.state.num_inflight += 1  # a drain waits for it like for a connection
        try:
            await self._produce_inner(entry, p)
        finally:
            self.state.num_inflight -= 1

    async def _produce_inner(self, entry: IdempotencyEntry, p: Prepared) -> None:
        gen, fmt = self.generation(p)
        if not p.request.stream:
            response = await self._collect(gen, fmt, p)  # APIError: refused, not stored
            entry.result = (response.status_code, response.body,
                            {k: v for k, v in response.headers.items()
                             if k.startswith("x-servelm")})
            entry.ready.set_result(True)
            return
        await self.start(gen)
        entry.ready.set_result(True)
        try:
            async for event in sse_events(gen, fmt, p):
                entry.events.append(event)
                entry._notify()
        finally:
            self.log(gen, p)

    # -- logging ---------------------------------------------------------------------------

    def log(self, gen: Generation, p: Prepared) -> None:
        if gen.logged:
            return
        gen.logged = True
        if gen.lora_name is not None and self.state.lora_metrics is not None:
            self.state.lora_metrics.record_request(gen.lora_name, gen.num_prompt_tokens,
                                                   gen.num_completion_tokens)
        record = {
            "request_id": gen.base_id,
            "endpoint": p.endpoint or p.kind,
            "status": gen.status,
            "stream": bool(p.request.stream),
            "n": gen.n,
            "num_prompts": len(gen.requests),
            "finish_reasons": [c.finish_reason for c in gen.choices],
            "deadline_hit": gen.deadline_hit,
            "user": p.request.user,
            "latency_s": round(time.monotonic() - gen.arrival, 6),
            "timing": gen.timing(),
        }
        request_logger.info(json.dumps(record, ensure_ascii=False))
        self.state.metrics.record_request(gen, p.endpoint or p.kind, gen.status,
                                          bool(p.request.stream))
        self.state.metrics.reasoning_tokens.inc(gen.num_reasoning_tokens())


def _kv_transfer(request: Request):
    try:
        return kv_transfer_from_headers(request.headers)
    except InvalidParameterError as exc:
        raise APIError.from_invalid(exc) from None


def _header_json(obj: Any) -> str:
    # Header values must be latin-1; the breakdown is numbers and ASCII keys.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)
