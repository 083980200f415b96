"""The completion and chat endpoints: request -> EngineRequests -> stream or full response.

Owns: turning a validated OpenAI request into engine requests (tokenizing, chat template),
admission (draining -> 503, queue full -> 429, engine rejection -> 4xx), the per-request
deadline, disconnect handling (abort at once), Idempotency-Key attach/replay, and the one
structured log line per request.
Never: calls the Engine directly (only through AsyncEngine), or blocks the event loop on
model work (long prompts are tokenized in a worker thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from servelm.disagg.http import kv_transfer_from_headers, per_prompt
from servelm.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams, TokenDelta
from servelm.server.batch_quota import tenant_of
from servelm.server.errors import APIError, read_json_object
from servelm.parsers import get_reasoning_parser, get_tool_parser
from servelm.parsers.tool_parsers import JsonToolParser
from servelm.parsers.tool_prompt import tool_prompt
from servelm.server.formatting import (SSE_DONE, ChatFormatter, ChatOutput, ChoiceState,
                                       CompletionFormatter, EmbeddingFormatter, Formatter,
                                       finish_reason_name, num_reasoning_tokens, sse)
from servelm.server.idempotency import IdempotencyEntry, fingerprint
from servelm.server.metrics import REJECTION_REASON_BY_CODE, timing_breakdown
from servelm.server.reasoning_budget import thinking_budget
from servelm.server.schemas import (ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, EmbeddingRequest, TokenizeRequest,
                                    check_known_fields)
from servelm.server.sse import SSEResponse
from servelm.vision.pipeline import ImagePipeline, image_limits, vision_of

request_logger = logging.getLogger("servelm.requests")
logger = logging.getLogger(__name__)

# An ASGI scope key: the SLO class the server itself gives a request (a batch line runs in
# the lowest class, servelm/server/batch_runner.py), over what its body asks for.
SLO_CLASS_SCOPE_KEY = "servelm.slo_class"

# Prompts longer than this many characters are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 16_384

# Timing keys summed over prompts in a header summary; every other number is the worst
# (largest) prompt's.
_SUMMED_TIMING_KEYS = frozenset({"prompt_tokens", "completion_tokens", "num_preemptions",
                                 "num_cached_tokens"})


class ClientGone(Exception):
    """The HTTP client disconnected or stalled; the request was aborted."""


# -- one HTTP request's generation -----------------------------------------------------------


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n choices)."""

    def __init__(self, async_engine: AsyncEngine, base_id: str, prompts: list[list[int]],
                 params: SamplingParams, arrival: float, timeout_s: float | None,
                 client_param: Callable[[str | None], str | None] = lambda p: p,
                 lora_name: str | None = None, images: list | None = None):
        self.async_engine = async_engine
        self.client_param = client_param  # engine parameter name -> the field the client sent
        self.base_id = base_id
        self.n = params.n
        self.lora_name = lora_name  # a LoRA adapter every prompt runs with (None: the base)
        self.requests = [EngineRequest(f"{base_id}-{i}", ids, params, arrival_time=arrival,
                                       lora_name=lora_name, images=images or [])
                         for i, ids in enumerate(prompts)]
        self._prompt_index = {r.request_id: i for i, r in enumerate(self.requests)}
        self.arrival = arrival
        self.timeout_s = timeout_s
        self.deadline_hit = False
        self.stream: RequestStream | None = None
        self.timings: dict[str, Any] = {}  # request_id -> RequestTimings, when finished
        self.num_prompt_tokens = sum(len(ids) for ids in prompts)
        self.choices = [ChoiceState() for _ in range(len(prompts) * self.n)]
        self.status = "running"
        self.logged = False
        self._timer: asyncio.TimerHandle | None = None
        self.count_reasoning: Callable[[list[int]], int] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def start(self) -> None:
        """Submit and wait for admission; engine rejections raise APIError (4xx)."""
        loop = asyncio.get_running_loop()
        self.submitted = time.monotonic()  # arrival -> here: host work (request record)
        self.stream = self.async_engine.submit(self.requests)
        if self.timeout_s is not None:
            remaining = self.arrival + self.timeout_s - time.monotonic()
            self._timer = loop.call_later(max(0.0, remaining), self._on_deadline)
        try:
            await self.stream.admitted
        except InvalidParameterError as exc:
            self.close("rejected")
            exc.param = self.client_param(exc.param)
            raise APIError.from_invalid(exc) from None
        except EngineDeadError as exc:
            self.close("engine_dead")
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None
        except BaseException:
            self.close("cancelled")
            raise

    def _on_deadline(self) -> None:
        self.deadline_hit = True
        for r in self.requests:
            self.async_engine.abort(r.request_id)

    def cancel(self, why: str) -> None:
        """The client went away: abort now and wake whoever waits on the stream."""
        if self.stream is not None and not self.stream.is_finished:
            self.close(why)
            self.stream.fail(ClientGone(why))

    def close(self, status: str | None = None) -> None:
        if status is not None and self.status == "running":
            self.status = status
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.stream is not None:
            self.async_engine.release(self.stream)

    def index_of(self, d: TokenDelta) -> int:
        return self._prompt_index[d.request_id] * self.n + d.index

    def apply(self, d: TokenDelta) -> tuple[int, str | None]:
        """Fold a delta into its choice; (choice index, mapped finish reason or None)."""
        i = self.index_of(d)
        c = self.choices[i]
        c.text += d.text
        c.token_ids += d.token_ids
        if d.logprobs:
            c.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if d.embedding is not None:
            c.embedding = d.embedding
        c.num_prompt_tokens = d.num_prompt_tokens or c.num_prompt_tokens
        if d.timings is not None:
            self.timings[d.request_id] = d.timings
        reason = finish_reason_name(d.finish_reason, self.deadline_hit)
        if reason is not None:
            c.finish_reason = reason
        if d.error:
            raise RuntimeError(d.error)
        return i, reason

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens the prefix cache held
        (`prompt_tokens_details.cached_tokens`, as OpenAI reports its prompt caching) and
        the completion tokens spent thinking (`completion_tokens_details.reasoning_tokens`,
        counted when a reasoning parser reads the output; they are part of
        completion_tokens, as max_tokens counts them)."""
        p, c = self.num_prompt_tokens, self.num_completion_tokens
        cached = sum(t.num_cached_tokens for t in self.timings.values())
        reasoning = self.num_reasoning_tokens()
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": min(cached, p)},
                "completion_tokens_details": {"reasoning_tokens": reasoning}}

    def num_reasoning_tokens(self) -> int:
        """Completion tokens spent thinking, every choice's."""
        if self.count_reasoning is None:
            return 0
        return sum(self.count_reasoning(ch.token_ids) for ch in self.choices)

    def timing(self) -> Any:
        """One breakdown per prompt (a dict when there is one prompt)."""
        out = self._timings()
        return out[0] if len(out) == 1 else out

    def timing_summary(self) -> dict[str, Any]:
        """The breakdown for a header: one prompt's, or a summary of all of them whose size
        does not depend on the number of prompts (the per-prompt detail is in the log)."""
        return summarize_timings(self._timings())

    def _timings(self) -> list[dict[str, Any]]:
        out = []
        for i, r in enumerate(self.requests):
            completion = sum(len(c.token_ids) for c in self.choices[i * self.n:(i + 1) * self.n])
            out.append(timing_breakdown(self.timings.get(r.request_id),
                                        len(r.prompt_token_ids), completion))
        return out

    def timeout_error(self) -> APIError:
        return APIError(408, f"request timed out after {self.timeout_s:g}s before any token "
                        "was generated", "timeout_error", param="timeout",
                        code="request_timeout")


# -- the endpoint logic ----------------------------------------------------------------------


@dataclass
class Prepared:
    """A validated request, ready to run."""

    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    request: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    timeout_s: float | None
    arrival: float
    lora_name: str | None = None  # the request's `model` named a loaded LoRA adapter
    images: list | None = None  # a chat prompt's ImageInputs (vision models)
    kv_transfer: Any = None  # KVTransferParams from x-servelm-kv-transfer (disaggregation)
    endpoint: str | None = None  # the route's name in logs and records (default: kind)
    slo_class: str | None = None  # set by the server (SLO_CLASS_SCOPE_KEY), not the body


class OpenAIServing:
    def __init__(self, state):
        self.state = state  # ServerState (app.py)

    @property
    def config(self):
        return self.state.config

    @property
    def tokenizer(self):
        return self.state.async_engine.tokenizer

    # -- entry point -----------------------------------------------------------------------

    async def handle(self, request: Request, kind: str) -> Response:
        arrival = time.monotonic()
        state = self.state
        state.num_inflight += 1
        handed_off = False
        try:
            self._check_admission()
            body = await read_json_object(request, self.config.max_body_bytes)
            prepared = await self._prepare(kind, body, request, arrival)
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
            self._count_rejection(exc)
            return exc.response()
        finally:
            if not handed_off:
                state.num_inflight -= 1

    def _count_rejection(self, exc: APIError) -> None:
        reason = REJECTION_REASON_BY_CODE.get(exc.code or "")
        if reason is None:
            if exc.status == 503:
                reason = "draining"
            elif 400 <= exc.status < 500 and exc.status != 408:
                reason = "invalid"
            else:
                return
        self.state.metrics.rejected.labels(reason).inc()

    def _check_admission(self) -> None:
        if self.state.draining:
            raise APIError(503, "the server is shutting down", "server_error",
                           code="server_draining", headers={"Retry-After": "5"})
        if not self.state.async_engine.is_alive:
            raise APIError(503, "the engine is not running", "server_error",
                           code="engine_unavailable")
        if self.state.async_engine.num_waiting >= self.config.max_queue:
            raise APIError(429, f"too many requests waiting ({self.config.max_queue}); retry "
                           "later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    # -- validation ------------------------------------------------------------------------

    async def _prepare(self, kind: str, body: dict[str, Any], request: Request,
                       arrival: float) -> Prepared:
        schema = {"completion": CompletionRequest, "chat": ChatCompletionRequest,
                  "embedding": EmbeddingRequest}[kind]
        req = self._validate(schema, body)
        try:
            check_known_fields(body)
            req.check_unsupported()
            req.check_size(self.config.max_prompts, self.config.max_choices)
            params = req.sampling_params(self.config.max_n, self._bad_words)
            if kind == "chat":
                params = self._with_thinking_budget(req, params)
            params.check_vocab(self.vocab_size)
            if params.cache_retention_s:  # the tenant whose cap the retention counts in
                params = dataclasses.replace(params, prompt_cache_tenant=tenant_of(request))
            if params.structured is not None:
                await self._check_structured(params)
            if kind in ("completion", "embedding"):
                prompts, texts = await self._completion_prompts(req)
            else:
                images: list = []
                prompts, texts = await self._chat_prompts(req, images)
                self.state.metrics.observe_images(len(images))
        except InvalidParameterError as exc:
            exc.param = req.client_param(exc.param)
            raise APIError.from_invalid(exc) from None
        return Prepared(kind, body, req, params, prompts, texts,
                        self._timeout(request), arrival, self._lora_name(req.model),
                        images if kind == "chat" else None,
                        slo_class=request.scope.get(SLO_CLASS_SCOPE_KEY))


    def _with_thinking_budget(self, req: ChatCompletionRequest,
                              params: SamplingParams) -> SamplingParams:
        """params with the budget the request asks for (thinking_token_budget or
        reasoning_effort), in the reasoning parser's tags."""
        parser = (get_reasoning_parser(self.config.reasoning_parser)
                  if self.config.reasoning_parser else None)
        budget = thinking_budget(
            self.tokenizer, parser, num_tokens=req.thinking_token_budget,
            effort=req.reasoning_effort,
            max_tokens=params.max_tokens or self.state.async_engine.max_model_len)
        return params if budget is None else dataclasses.replace(params, thinking_budget=budget)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it starts the text and after a space (as vLLM bans them)."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("bad_words needs the model's tokenizer",
                                        param="bad_words")
        out = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tok.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    async def _check_structured(self, params: SamplingParams) -> None:
        """Compile the grammar here (cached per spec; off the event loop): a spec the library
        cannot compile is a 400 naming the field, before the engine sees it."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("structured outputs need the model's tokenizer",
                                        param=params.structured.param)
        from servelm.structured import compiler_for

        compiler = compiler_for(tok, self.vocab_size, tok.eos_token_ids)
        await asyncio.to_thread(compiler.grammar, params.structured)

    def _timeout(self, request: Request) -> float | None:
        raw = request.headers.get("timeout")
        if raw is None:
            return self.config.request_timeout
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise APIError(400, f"timeout header must be a positive number of seconds, got "
                           f"{raw!r}", param="timeout")
        return value

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("this model has no tokenizer; send token ids",
                                        param="prompt")
        if len(text) > _TOKENIZE_INLINE_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    async def _completion_prompts(self, req: CompletionRequest):
        ids_list, texts = [], []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self._encode(p)
                texts.append(p)
            else:
                ids = list(p)
                texts.append(self._decode_prompt(ids) if req.echo else None)
            if not ids:
                raise InvalidParameterError("prompt must not be empty", param="prompt")
            ids_list.append(ids)
        return ids_list, texts

    @property
    def vocab_size(self) -> int:
        return self.state.async_engine.vocab_size

    def _decode_prompt(self, ids: list[int]) -> str | None:
        vocab = self.vocab_size
        if self.tokenizer is None or any(not 0 <= t < vocab for t in ids):
            return None  # the engine rejects bad ids with a clear error
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def _chat_prompts(self, req: ChatCompletionRequest, images_out: list | None = None):
        """The chat prompt's ids; with image parts, each image's placeholder expanded to its
        tokens and its ImageInput appended to images_out (servelm/vision/)."""
        vision = vision_of(self.state.async_engine)
        parts: list = []
        messages = req.template_messages(parts, vision.image_prompt if vision else None)
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("this model has no tokenizer", param="messages")
        mode, _ = req.tool_mode()
        tools = [t.to_template() for t in req.tools] if req.tools and mode != "none" else None
        messages, extra = tool_prompt(tok.chat_template, messages, tools,
                                      self._tool_parser(mode))
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=
                                           req.add_generation_prompt, **extra)
        except InvalidParameterError:
            raise
        except Exception as exc:  # a template error is about these messages
            raise InvalidParameterError(f"cannot apply the chat template: {exc}",
                                        param="messages") from None
        ids = await self._encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidParameterError("messages render to an empty prompt", param="messages")
        if parts:
            ids, inputs = await self._images(vision).prepare(ids, parts)
            if images_out is not None:
                images_out += inputs
        return [ids], [None]

    def _images(self, vision):
        """The image pipeline (decode, limits, preprocessing in worker threads), made once."""
        pipeline = getattr(self.state, "image_pipeline", None)
        if pipeline is None:
            pipeline = self.state.image_pipeline = ImagePipeline(vision,
                                                                 image_limits(self.config))
        return pipeline

    # -- /tokenize and /detokenize ---------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """{"count", "max_model_len", "tokens"[, "token_strs"]}: the ids a completion (prompt)
        or chat (messages, through the template) request would be given."""
        try:
            req = await self._small_request(request, TokenizeRequest)
            req.check()
            if req.prompt is not None:
                ids = await self._encode(req.prompt, req.add_special_tokens)
            else:
                chat = ChatCompletionRequest(messages=req.messages,
                                             add_generation_prompt=req.add_generation_prompt)
                (ids,), _ = await self._chat_prompts(chat)
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        body: dict[str, Any] = {"count": len(ids), "tokens": ids,
                                "max_model_len": self.state.async_engine.max_model_len}
        if req.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        """{"prompt": text} of token ids (special tokens kept, as they were sent)."""
        try:
            req = await self._small_request(request, DetokenizeRequest)
            if self.tokenizer is None:
                raise InvalidParameterError("this model has no tokenizer", param="tokens")
            vocab = self.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidParameterError(f"tokens: token id {bad} is outside the "
                                            f"vocabulary [0, {vocab})", param="tokens")
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens,
                                                             skip_special_tokens=False)})

    # -- LoRA adapters at run time (vLLM's routes and bodies) ------------------------------

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await read_json_object(request, self.config.max_body_bytes)
        name, path = _lora_fields(body, ("lora_name", "lora_path"))
        await self._lora_call(self.state.async_engine.load_lora(name, path))
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await read_json_object(request, self.config.max_body_bytes)
        (name,) = _lora_fields(body, ("lora_name",), optional=("lora_int_id", "lora_path"))
        await self._lora_call(self.state.async_engine.unload_lora(name))
        logger.info("LoRA adapter %r unloaded (requests using it run to their end)", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _lora_call(self, call) -> None:
        try:
            await call
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None

    async def _small_request(self, request: Request, schema):
        body = await read_json_object(request, self.config.max_body_bytes)
        return self._validate(schema, body)

    def _validate(self, schema, body: dict[str, Any]):
        """`body` as `schema`, for the model this server serves (400 / 404 naming the field)."""
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            raise APIError.from_validation(exc) from None
        if req.model is not None and req.model != self.config.served_model_name \
                and req.model not in self.state.async_engine.lora_names:
            adapters = self.state.async_engine.lora_names
            also = f" and the LoRA adapters {', '.join(adapters)}" if adapters else ""
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                           f"`{self.config.served_model_name}`{also}", param="model",
                           code="model_not_found")
        return req

    def _lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        if model is None or model == self.config.served_model_name:
            return None
        return model

    # -- chat output parsing ---------------------------------------------------------------

    def _tool_parser(self, mode: str):
        """required / named choices are constrained to JSON calls (ChatCompletionRequest
        .structured); auto reads the model's own format."""
        if mode in ("required", "named"):
            return JsonToolParser()
        return get_tool_parser(self.config.tool_call_parser)

    def _chat_output(self, req: ChatCompletionRequest) -> ChatOutput:
        mode, _ = req.tool_mode()
        reasoning = (get_reasoning_parser(self.config.reasoning_parser)
                     if self.config.reasoning_parser else None)
        if mode == "none":
            return ChatOutput(reasoning_parser=reasoning)
        return ChatOutput(self._tool_parser(mode), reasoning,
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

    async def _start(self, gen: Generation) -> None:
        """Submit; a request refused or cancelled before admission gets no delta, so its
        SLO class entry (_attach_slo) is dropped here rather than kept forever."""
        try:
            await gen.start()
        except BaseException:
            for r in gen.requests:
                self.state.metrics.request_classes.pop(r.request_id, None)
            raise

    def _generation(self, p: Prepared) -> tuple[Generation, Formatter]:
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
        await self._start(gen)
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
            self._log(gen, p)
            raise gen.timeout_error()
        timing = gen.timing_summary()
        self._log(gen, p)
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
        gen, fmt = self._generation(p)
        task = asyncio.ensure_future(self._collect(gen, fmt, p))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
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
            self._log(gen, p)
            return Response(status_code=499)  # nobody reads it
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                gen.close("cancelled")

    async def _start_stream(self, p: Prepared) -> SSEResponse:
        gen, fmt = self._generation(p)
        await self._start(gen)  # 4xx before any byte of the stream is sent
        state = self.state

        def on_close() -> None:
            gen.close("finished")
            state.num_inflight -= 1
            self._log(gen, p)

        def on_disconnect(why: str) -> None:
            gen.status = "client_disconnected" if why == "disconnect" else "write_timeout"
            gen.cancel(why)

        return SSEResponse(self._events(gen, fmt, p), write_timeout=self.config.write_timeout,
                           on_disconnect=on_disconnect, on_close=on_close)

    async def _events(self, gen: Generation, fmt: Formatter, p: Prepared) -> AsyncIterator[str]:
        """SSE events of one started generation, ending with [DONE] (unless the client left)."""
        try:
            async with aclosing(self._chunks(gen, fmt, p)) as chunks:
                async for chunk in chunks:
                    yield sse(chunk)
        except ClientGone:
            return
        yield SSE_DONE

    async def _chunks(self, gen: Generation, fmt: Formatter, p: Prepared
                      ) -> AsyncIterator[dict[str, Any]]:
        """The stream chunks of one started generation; a failure after the start is one
        last `{"error": ...}` chunk; ClientGone when the client left (the Responses API
        reads the same chunks). Each `await gen.stream.get()` takes everything pending,
        merged per choice."""
        try:
            for i in range(gen.num_choices):
                for chunk in fmt.first_chunks(i, p.prompt_texts[i // gen.n]):
                    yield chunk
            while True:
                deltas = await gen.stream.get()
                if not deltas:
                    break
                if (gen.deadline_hit and gen.num_completion_tokens == 0
                        and not any(d.token_ids for d in deltas)):
                    gen.status = "timeout"
                    yield gen.timeout_error().body()
                    return
                for d in deltas:
                    i, reason = gen.apply(d)
                    if d.text or d.logprobs:
                        chunk = fmt.delta_chunk(i, d)
                        if chunk is not None:
                            yield chunk
                    if reason is not None:
                        for chunk in fmt.finish_chunks(i, reason):
                            yield chunk
            if p.request.include_usage:
                yield fmt.usage_chunk(gen.usage(), gen.timing())
        except ClientGone:
            raise
        except Exception as exc:  # mid-stream failure: an error chunk
            logger.exception("stream %s failed", gen.base_id)
            gen.status = "error"
            err = APIError(500, f"generation failed: {exc}", "server_error",
                           code="engine_unavailable" if isinstance(exc, EngineDeadError)
                           else "internal_error")
            yield err.body()
        finally:
            gen.close("finished")

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
            await _until_ready_or_disconnect(entry.ready, request)
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
        gen, fmt = self._generation(p)
        if not p.request.stream:
            response = await self._collect(gen, fmt, p)  # APIError: refused, not stored
            entry.result = (response.status_code, response.body,
                            {k: v for k, v in response.headers.items()
                             if k.startswith("x-servelm")})
            entry.ready.set_result(True)
            return
        await self._start(gen)
        entry.ready.set_result(True)
        try:
            async for event in self._events(gen, fmt, p):
                entry.events.append(event)
                entry._notify()
        finally:
            self._log(gen, p)

    # -- logging ---------------------------------------------------------------------------

    def _log(self, gen: Generation, p: Prepared) -> None:
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


def _lora_fields(body: dict[str, Any], required: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> list[str]:
    """The string fields of a load/unload body; a missing, mistyped or unknown field is a
    400 naming it."""
    for key in body:
        if key not in required and key not in optional and key != "load_inplace":
            raise APIError(400, f"unknown field {key!r}", param=key, code="unsupported_field")
    if body.get("load_inplace"):
        raise APIError(400, "load_inplace is not supported: unload the adapter, then load it",
                       param="load_inplace", code="unsupported_field")
    out = []
    for key in required:
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"{key} must be a non-empty string", param=key)
        out.append(value)
    return out


def best_of(choices: list[ChoiceState], num_candidates: int, n: int,
            keep_logprobs: bool) -> list[ChoiceState]:
    """Per prompt, the n candidates whose tokens have the highest total logprob (OpenAI's
    best_of), in that order."""
    out = []
    for start in range(0, len(choices), num_candidates):
        group = choices[start:start + num_candidates]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        for c in ranked[:n]:
            if not keep_logprobs:
                c.logprobs = []
            out.append(c)
    return out


def summarize_timings(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt's breakdown as it is; for several, the same keys with counts summed and
    times (seconds) the largest over prompts, plus `num_prompts`: a fixed size whatever the
    number of prompts."""
    if len(timings) == 1:
        return timings[0]
    out: dict[str, Any] = {"num_prompts": len(timings)}
    for key in dict.fromkeys(k for t in timings for k in t):
        values = [t[key] for t in timings if t.get(key) is not None]
        if not values:
            out[key] = None
        elif key in _SUMMED_TIMING_KEYS:
            out[key] = sum(values)
        else:
            out[key] = max(values)
    return out


def _kv_transfer(request: Request):
    try:
        return kv_transfer_from_headers(request.headers)
    except InvalidParameterError as exc:
        raise APIError.from_invalid(exc) from None


def _header_json(obj: Any) -> str:
    # Header values must be latin-1; the breakdown is numbers and ASCII keys.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_ready_or_disconnect(fut, request: Request) -> None:
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    waiter = asyncio.ensure_future(asyncio.shield(fut))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            waiter.result()  # re-raise a refusal
            return
        raise ClientGone("disconnect")
    finally:
        watcher.cancel()
        if not waiter.done():
            waiter.cancel()
