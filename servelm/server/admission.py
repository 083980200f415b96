"""Request admission and validation: from an HTTP body to a request ready to run, or a 4xx/5xx.

Owns: whether a request may enter now (draining -> 503, engine gone -> 503, queue full ->
429), the refusal counters, validating a body against its schema for the model this server
serves (400 / 404 naming the field), the request's sampling parameters (bad words, thinking
budget, a structured-output grammar compiled before the engine sees it), its deadline (the
`timeout` header), its LoRA adapter, its SLO class set by the server, and Prepared, the
result every endpoint runs.
Never: submits to the engine (serving.py does), or blocks the event loop (grammars compile on
a worker thread; prompts.py tokenizes long texts on one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from servelm.parsers import get_reasoning_parser
from servelm.protocol import InvalidParameterError, SamplingParams
from servelm.server.batch_quota import tenant_of
from servelm.server.errors import APIError
from servelm.server.metrics import REJECTION_REASON_BY_CODE
from servelm.server.prompts import Prompts
from servelm.server.reasoning_budget import thinking_budget
from servelm.server.schemas import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                    check_known_fields)

# An ASGI scope key: the SLO class the server itself gives a request (a batch line runs in
# the lowest class, servelm/server/batch_runner.py), over what its body asks for.
SLO_CLASS_SCOPE_KEY = "servelm.slo_class"

_SCHEMAS = {"completion": CompletionRequest, "chat": ChatCompletionRequest,
            "embedding": EmbeddingRequest}


@dataclass
class Prepared:
    """A validated request, ready to run."""

    kind: str  # "completion" | "chat" | "embedding"
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


class Admission:
    """Admits and validates requests for the server whose ServerState (app.py) is `state`."""

    def __init__(self, state, prompts: Prompts):
        self.state = state
        self.prompts = prompts

    @property
    def config(self):
        return self.state.config

    def check(self) -> None:
        """Refuse a request the server cannot take now (before its body is read)."""
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

    def count_rejection(self, exc: APIError) -> None:
        reason = REJECTION_REASON_BY_CODE.get(exc.code or "")
        if reason is None:
            if exc.status == 503:
                reason = "draining"
            elif 400 <= exc.status < 500 and exc.status != 408:
                reason = "invalid"
            else:
                return
        self.state.metrics.rejected.labels(reason).inc()

    def validate(self, schema, body: dict[str, Any]):
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

    async def prepare(self, kind: str, body: dict[str, Any], request: Request,
                      arrival: float) -> Prepared:
        """A `kind` request's body checked, its sampling parameters and prompts made."""
        req = self.validate(_SCHEMAS[kind], body)
        try:
            check_known_fields(body)
            req.check_unsupported()
            req.check_size(self.config.max_prompts, self.config.max_choices)
            params = req.sampling_params(self.config.max_n, self._bad_words)
            if kind == "chat":
                params = self._with_thinking_budget(req, params)
            params.check_vocab(self.prompts.vocab_size)
            if params.cache_retention_s:  # the tenant whose cap the retention counts in
                params = dataclasses.replace(params, prompt_cache_tenant=tenant_of(request))
            if params.structured is not None:
                await self._check_structured(params)
            if kind in ("completion", "embedding"):
                prompts, texts = await self.prompts.completion(req)
            else:
                images: list = []
                prompts, texts = await self.prompts.chat(req, images)
                self.state.metrics.observe_images(len(images))
        except InvalidParameterError as exc:
            exc.param = req.client_param(exc.param)
            raise APIError.from_invalid(exc) from None
        return Prepared(kind, body, req, params, prompts, texts,
                        self._timeout(request), arrival, self.lora_name(req.model),
                        images if kind == "chat" else None,
                        slo_class=request.scope.get(SLO_CLASS_SCOPE_KEY))

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        if model is None or model == self.config.served_model_name:
            return None
        return model

    def _with_thinking_budget(self, req: ChatCompletionRequest,
                              params: SamplingParams) -> SamplingParams:
        """params with the budget the request asks for (thinking_token_budget or
        reasoning_effort), in the reasoning parser's tags."""
        parser = (get_reasoning_parser(self.config.reasoning_parser)
                  if self.config.reasoning_parser else None)
        budget = thinking_budget(
            self.prompts.tokenizer, parser, num_tokens=req.thinking_token_budget,
            effort=req.reasoning_effort,
            max_tokens=params.max_tokens or self.state.async_engine.max_model_len)
        return params if budget is None else dataclasses.replace(params, thinking_budget=budget)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it starts the text and after a space (as vLLM bans them)."""
        tok = self.prompts.tokenizer
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
        tok = self.prompts.tokenizer
        if tok is None:
            raise InvalidParameterError("structured outputs need the model's tokenizer",
                                        param=params.structured.param)
        from servelm.structured import compiler_for

        compiler = compiler_for(tok, self.prompts.vocab_size, tok.eos_token_ids)
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
