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

from servelm.parsers import ReasoningParser, ReasoningStream, ToolCallStream, ToolParser
from servelm.parsers.reasoning_parsers import END as END_OF_THINKING
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

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        return [self.finish_chunk(index, reason)]


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


@dataclass
class ChatOutput:
    """How a chat's output text is read: thinking apart (reasoning parser), tool calls out
    of the content (tool parser), at most `max_calls` of them, finishing with
    `tool_finish_reason` when there are calls (OpenAI: "tool_calls"; a named tool_choice
    finishes with "stop")."""

    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    max_calls: int | None = None
    tool_finish_reason: str = "tool_calls"

    @property
    def is_plain(self) -> bool:
        return self.tool_parser is None and self.reasoning_parser is None


class _ChoiceStream:
    """One streamed choice's text so far and its parsers' state."""

    def __init__(self, output: ChatOutput):
        self.text = ""
        self.content = ""  # sent, when there is no tool parser
        self.reasoning = (ReasoningStream(output.reasoning_parser)
                          if output.reasoning_parser else None)
        self.tools = (ToolCallStream(output.tool_parser, output.max_calls)
                      if output.tool_parser else None)

    def advance(self, final: bool) -> dict[str, Any]:
        """The delta of everything now known to be reasoning, content or a call."""
        delta: dict[str, Any] = {}
        content = self.text
        if self.reasoning is not None:
            thought, content = self.reasoning.update(self.text, final)
            if thought:
                delta["reasoning_content"] = thought
        if self.tools is not None:
            text, calls = self.tools.update(content, final)
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
        elif content.startswith(self.content) and len(content) > len(self.content):
            delta["content"] = content[len(self.content):]
            self.content = content
        return delta


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer, request_id, model, num_choices, want_logprobs: bool,
                 output: ChatOutput | None = None):
        super().__init__(tokenizer, request_id, model, num_choices)
        self.want_logprobs = want_logprobs
        self.output = output or ChatOutput()
        self._streams = [_ChoiceStream(self.output) for _ in range(num_choices)] \
            if not self.output.is_plain else []

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

    def delta_chunk(self, index: int, d: TokenDelta) -> dict[str, Any] | None:
        """None: nothing to send yet (text held back until a parser knows what it is)."""
        if self.output.is_plain:
            delta: dict[str, Any] = {"content": d.text}
        else:
            stream = self._streams[index]
            stream.text += d.text
            delta = stream.advance(final=False)
            if not delta and not (self.want_logprobs and d.logprobs):
                return None
        return self._chunk([{"index": index, "delta": delta,
                             "logprobs": self.logprobs(d.logprobs), "finish_reason": None}])

    def finish_chunk(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                             "finish_reason": reason}])

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        if self.output.is_plain:
            return [self.finish_chunk(index, reason)]
        stream = self._streams[index]
        out = []
        delta = stream.advance(final=True)
        if delta:
            out.append(self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                     "finish_reason": None}]))
        if reason == "stop" and stream.tools is not None and stream.tools.has_calls:
            reason = self.output.tool_finish_reason
        out.append(self.finish_chunk(index, reason))
        return out

    def message(self, c: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole choice, and its finish reason."""
        out = self.output
        msg: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = c.finish_reason
        content = c.text
        if out.reasoning_parser is not None:
            split = out.reasoning_parser.split(c.text, final=True)
            msg["reasoning_content"] = split.reasoning or None
            content = msg["content"] = split.content
        if out.tool_parser is not None:
            text, calls = out.tool_parser.parse(content)
            if out.max_calls:
                calls = calls[:out.max_calls]
            if calls:
                msg["content"] = text
                msg["tool_calls"] = [call.to_openai() for call in calls]
                if reason == "stop":
                    reason = out.tool_finish_reason
        return msg, reason

    def response(self, choices: list[ChoiceState], prompt_texts: list[str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            msg, reason = self.message(c)
            out.append({"index": i, "message": msg,
                        "logprobs": self.logprobs(c.logprobs) if self.want_logprobs else None,
                        "finish_reason": reason})
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": out, "usage": usage}


def num_reasoning_tokens(tokenizer, token_ids: list[int], parser: ReasoningParser) -> int:
    """Output tokens up to and including the end of the thinking: the shortest prefix whose
    text closes it (found by bisection), or every token when it never closes."""
    if tokenizer is None or not token_ids:
        return 0
    full = parser.split(tokenizer.decode(token_ids, skip_special_tokens=False), final=True)
    if not full.reasoning:
        return 0
    if not full.is_reasoning_done:
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:  # "the end tag is in the text" only grows with the prefix
        mid = (lo + hi) // 2
        if END_OF_THINKING in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo
