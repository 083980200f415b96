"""LLM: the offline Python API. `LLM(model).generate(prompts, SamplingParams)`.

LoRA: `LLM(model, lora_modules=("name=path",))` or `llm.load_lora(name, path)`, then
`generate(prompts, params, lora="name")` (one name for all prompts, or one per prompt; None
runs the base model)."""

from __future__ import annotations

import itertools
import sys
from typing import Sequence as Seq

from tqdm import tqdm

from servelm.config import EngineArgs
from servelm.engine.engine import Engine
from servelm.protocol import (CompletionOutput, EngineRequest, InvalidParameterError,
                              RequestOutput, SamplingParams, TokenDelta)


class LLM:
    """Runs batches of prompts through one engine with continuous batching."""

    def __init__(self, model: str | None = None, *, engine: Engine | None = None, **kwargs):
        if engine is None:
            if model is None:
                raise InvalidParameterError("model is required", param="model")
            from servelm.engine_builder import build_engine

            engine = build_engine(EngineArgs(model=model, **kwargs))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora: str | Seq[str | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts: text, token ids, or a list of either. Returns outputs in prompt order.
        lora: the adapter name for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidParameterError("sampling_params must be one or one per prompt",
                                        param="sampling_params")
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise InvalidParameterError("lora must be one adapter name or one per prompt",
                                        param="lora")
        requests = [self._request(p, sp) for p, sp in zip(prompts, sampling_params)]
        for r, name in zip(requests, lora):
            r.lora_name = name
        added = []
        try:
            for r in requests:
                self.engine.add_request(r)
                added.append(r.request_id)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            self._drain()
            raise
        return self._run(requests, use_tqdm)

    def load_lora(self, name: str, path: str) -> None:
        """Register the PEFT adapter at `path` as `name` (checked against the base model)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (list of messages) or several; rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.encode_chat(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None:
            raise InvalidParameterError("this engine has no tokenizer", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes the special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _request(self, prompt, params: SamplingParams) -> EngineRequest:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError("text prompts need a tokenizer", param="prompt")
            ids = self.tokenizer.encode(prompt)
            return EngineRequest(str(next(self._ids)), ids, params, prompt=prompt)
        return EngineRequest(str(next(self._ids)), list(prompt), params)

    def _run(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        outputs = {r.request_id: RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                                               [CompletionOutput(i, "", [], None)
                                                for i in range(r.sampling_params.n)], None)
                   for r in requests}
        bar = tqdm(total=len(requests), desc="generate", unit="req", file=sys.stderr,
                   disable=not use_tqdm or len(requests) < 2)
        while self.engine.has_unfinished:
            for delta in self.engine.step():
                out = outputs.get(delta.request_id)
                if out is not None:
                    _merge(out, delta)
                    if delta.timings is not None:
                        bar.update(1)
        bar.close()
        return [outputs[r.request_id] for r in requests]

    def _drain(self) -> None:
        while self.engine.has_unfinished:
            self.engine.step()


def _merge(out: RequestOutput, delta: TokenDelta) -> None:
    c = out.outputs[delta.index]
    c.text += delta.text
    c.token_ids += delta.token_ids
    if delta.logprobs is not None:
        c.logprobs = (c.logprobs or []) + delta.logprobs
    if delta.prompt_logprobs is not None:
        c.prompt_logprobs = delta.prompt_logprobs
    if delta.embedding is not None:
        c.embedding = delta.embedding
    if delta.finish_reason is not None:
        c.finish_reason = delta.finish_reason
    if delta.timings is not None:
        out.timings = delta.timings
