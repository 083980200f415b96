"""ResponseBuilder: one Responses API body and its stream events, from chat stream chunks.

Owns: the Response object's shape (the official openai client parses it), its output items
(reasoning, message, function_call) built from the chat path's stream deltas, the final
status (completed / incomplete / failed / cancelled) and usage, and the stream events in
their documented order, each with its sequence_number:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      reasoning: the same with response.reasoning_text.delta / .done
      function_call: response.function_call_arguments.delta..., .done
    response.output_item.done, ..., then response.completed | .incomplete | .failed

Streamed, background and plain requests all go through it, so their bodies are the same.
Never: talks to the engine or the store, or parses model text (the chat path's parsers did).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from servelm.server.responses_schema import new_id


class ResponseBuilder:
    """Chat chunks in (`feed`), events out; `body` is the response so far."""

    def __init__(self, body: dict[str, Any]):
        self.body = body
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.body["output"]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return event

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot())]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat stream chunk (a delta, a finish, usage or an error)."""
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        if chunk.get("usage"):
            self.body["usage"] = _usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    # -- items -----------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.output.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", item=copy.deepcopy(item),
                                  output_index=len(self.output) - 1))
        if item["type"] != "function_call":
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            part = {"type": kind, "text": ""}
            if kind == "output_text":
                part["annotations"] = []
            item["content"].append(part)
            events.append(self._event("response.content_part.added", part=dict(part),
                                      **self._where(item), content_index=0))
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._add(_text_item(kind))
        part = self.open["content"][0]
        part["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"response.{name}.delta", **self._where(self.open),
                                  content_index=0, delta=text, **extra))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                    "name": fn["name"], "arguments": "", "status": "in_progress"}
            self.calls[delta["index"]] = item
            events += self._add(item)
        fragment = fn.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(item), delta=fragment))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self._event(f"response.{name}.done", **where, content_index=0,
                                  text=part["text"], **extra),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=dict(part))]
        events.append(self._event("response.output_item.done", item=copy.deepcopy(item),
                                  output_index=where["output_index"]))
        return events

    # -- the end -----------------------------------------------------------------------------

    def finish(self, cancelled: bool = False) -> list[dict[str, Any]]:
        """Close the open item, set the final status; the last event names it."""
        status, incomplete, error = self._final_status(cancelled)
        events: list[dict[str, Any]] = []
        if status in ("completed", "incomplete") and not any(
                i["type"] in ("message", "function_call") for i in self.output):
            events += self._add(_text_item("message"))  # an empty answer is still one
        events += self._close("completed" if status == "completed" else "incomplete")
        self.body.update(status=status, incomplete_details=incomplete, error=error,
                         completed_at=int(time.time()) if status == "completed" else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}.get(status)
        if kind is not None:
            events.append(self._event(kind, response=self.snapshot()))
        return events

    def _final_status(self, cancelled: bool):
        if cancelled:
            return "cancelled", None, None
        if self.error is not None:
            err = self.error.get("error", self.error)
            return "failed", None, {"code": "server_error",
                                    "message": str(err.get("message", "generation failed"))}
        if self.finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}, None
        if self.finish_reason == "abort" or self.finish_reason is None:
            return "failed", None, {"code": "server_error",
                                    "message": "the generation was aborted"}
        return "completed", None, None


def _text_item(kind: str) -> dict[str, Any]:
    item: dict[str, Any] = {"id": new_id("msg" if kind == "message" else "rs"), "type": kind,
                            "status": "in_progress", "content": []}
    if kind == "message":
        item["role"] = "assistant"
    else:
        item["summary"] = []
    return item


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat path's usage in the Responses API's names."""
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat["total_tokens"]}


__all__ = ["ResponseBuilder"]
