"""OpenAI response bodies: completion / chat objects, stream chunks, logprobs, usage.

Owns: the exact JSON shapes the OpenAI API returns (so the official client parses them), and
the per-choice state needed to build them (text so far, text offsets for logprobs).
Never: talks to the engine or decides finish reasons (it only maps them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from servelm.protocol import FinishReason, Logprob, TokenDelta


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # echo with logprobs
    embedding: list[float] | None = None


def finish_reason_name(reason: FinishReason | None, deadline_hit: bool) -> str | None:
    """The engine's abort after a deadline is reported as "length": the output was cut by a
    limit, like max_tokens (docs/server.md). Any other abort is reported as "abort"."""
    if reason is None:
        return None
    if reason == FinishReason.ABORT and deadline_hit:
        return "length"
    return reason.value


class Formatter:
    """Builds one response (one id, created time, model) for `num_choices` choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, tokenizer, request_id: str, model: str, num_choices: int):
        self.tokenizer = tokenizer
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_choices = num_choices
        self._text_offsets = [0] * num_choices

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}

    def usage_chunk(self, usage: dict[str, int], timing: Any) -> dict[str, Any]:
        return self._chunk([], usage=usage, timing=timing)

    # subclasses: first_chunks, delta_chunk, finish_chunk, response
    def first_chunks(self, index: int, prompt_text: str | None) -> list[dict[str, Any]]:
        return []


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, tokenizer, request_id, model, num_choices, echo: bool,
                 prompt_ids: list[list[int]] | None = None, echo_logprobs: bool = False):
        """echo_logprobs: echo with logprobs, so the echoed prompt carries its tokens'
        logprobs (they come with each choice's first delta; `prompt_ids[i // n]` names the
        prompt's tokens, whose first has no logprob)."""
        super().__init__(tokenizer, request_id, model, num_choices)
        self.echo = echo
        self.echo_logprobs = echo and echo_logprobs
        self.prompt_ids = prompt_ids or []
        self._prompt_texts: dict[int, str] = {}

    def _prompt_entries(self, index: int, lps: list[Logprob | None]) -> list[Logprob | None]:
        """Prompt logprobs with the first token's id filled in (its logprob stays None)."""
        n = self.num_choices // max(1, len(self.prompt_ids))
        ids = self.prompt_ids[index // max(1, n)] if self.prompt_ids else []
        return [lp if lp is not None else (Logprob(ids[j], None) if j < len(ids) else None)
                for j, lp in enumerate(lps)]

    def logprobs(self, index: int, lps: list[Logprob | None] | None, text_before: int
                 ) -> dict[str, Any] | None:
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_before
        for lp in lps:
            if lp is None:
                continue
            tok = self.token_text(lp.token_id)
            tokens.append(tok)
            token_lps.append(lp.logprob)
            tops.append({self.token_text(t): v for t, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps,
                "top_logprobs": tops if any(t is not None for t in tops) else None,
                "text_offset": offsets}

    def first_chunks(self, index, prompt_text):
        if not self.echo or not prompt_text:
            return []
        if self.echo_logprobs:  # sent with the first delta, with the prompt's logprobs
            self._prompt_texts[index] = prompt_text
            return []
        self._text_offsets[index] += len(prompt_text)
        return [self._chunk([{"index": index, "text": prompt_text, "logprobs": None,
                              "finish_reason": None}])]

    def delta_chunk(self, index: int, d: TokenDelta) -> dict[str, Any]:
        text, lps = d.text, d.logprobs
        prompt_text = self._prompt_texts.pop(index, None)
        if prompt_text is not None:
            text = prompt_text + text
            lps = self._prompt_entries(index, d.prompt_logprobs or []) + list(lps or [])
        lp = self.logprobs(index, lps, self._text_offsets[index])
        self._text_offsets[index] += len(text)
        return self._chunk([{"index": index, "text": text, "logprobs": lp,
                             "finish_reason": None}])

    def finish_chunk(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk([{"index": index, "text": "", "logprobs": None,
                             "finish_reason": reason}])

    def response(self, choices: list[ChoiceState], prompt_texts: list[str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        out = []
        n = len(choices) // max(1, len(prompt_texts))
        for i, c in enumerate(choices):
            prefix = (prompt_texts[i // n] or "") if self.echo else ""
            lps = None
            if self.echo_logprobs:
                lps = self.logprobs(i, self._prompt_entries(i, c.prompt_logprobs or [])
                                    + c.logprobs, 0)
            elif c.logprobs:
                lps = self.logprobs(i, c.logprobs, len(prefix))
            out.append({"index": i, "text": prefix + c.text, "logprobs": lps,
                        "finish_reason": c.finish_reason})
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": out, "usage": usage}


class EmbeddingFormatter(Formatter):
    """/v1/embeddings: one embedding per input, L2-normalised (as OpenAI's are)."""

    object_name = "list"

    def __init__(self, tokenizer, request_id, model, num_choices, encoding_format: str):
        super().__init__(tokenizer, request_id, model, num_choices)
        self.encoding_format = encoding_format

    def response(self, choices: list[ChoiceState], prompt_texts: list[str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        data = []
        for i, c in enumerate(choices):
            vec = c.embedding or []
            norm = sum(x * x for x in vec) ** 0.5 or 1.0
            vec = [x / norm for x in vec]
            if self.encoding_format == "base64":
                import base64
                import struct

                value: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            else:
                value = vec
            data.append({"object": "embedding", "index": i, "embedding": value})
        p = usage["prompt_tokens"]
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": p, "total_tokens": p}}


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer, request_id, model, num_choices, want_logprobs: bool):
        super().__init__(tokenizer, request_id, model, num_choices)
        self.want_logprobs = want_logprobs

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self.token_bytes(token_id))}

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: `token` may be U+FFFD for part of a character, `bytes`
        never is (the bytes of a reply's tokens join to its UTF-8 text)."""
        if self.tokenizer is None:
            return self.token_text(token_id).encode("utf-8")
        return self.tokenizer.token_bytes(token_id)

    def logprobs(self, lps: list[Logprob] | None) -> dict[str, Any] | None:
        if not self.want_logprobs or lps is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def first_chunks(self, index, prompt_text):
        return [self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])]

    def delta_chunk(self, index: int, d: TokenDelta) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {"content": d.text},
                             "logprobs": self.logprobs(d.logprobs), "finish_reason": None}])

    def finish_chunk(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                             "finish_reason": reason}])

    def response(self, choices: list[ChoiceState], prompt_texts: list[str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        out = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.logprobs) if self.want_logprobs else None,
                "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": out, "usage": usage}
