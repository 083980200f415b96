"""The Responses API request (POST /v1/responses) and its chat form.

Owns: which Responses fields servelm implements, and the refusal by name of every other
field (a known OpenAI field that asks for something, or a field OpenAI does not have);
input items (a string, messages, function_call, function_call_output, reasoning) normalised
into the items the store keeps and input_items lists; those items and a previous turn's
output into chat messages; tools, tool_choice and text.format into their chat forms, so the
chat path (chat template, tool-call and reasoning parsers, structured outputs) serves it.
Never: talks to the engine or the store, or builds a response body (responses_output.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from servelm.protocol import InvalidParameterError
from servelm.server.schemas import Number

# The fields servelm implements.
_IMPLEMENTED = frozenset({
    "model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
    "parallel_tool_calls", "text", "max_output_tokens", "temperature", "top_p", "store",
    "background", "stream", "metadata", "user", "safety_identifier", "prompt_cache_key",
    "reasoning", "thinking_token_budget",  # a reasoning budget (reasoning_budget.py)
    "prompt_cache_retention",
    "structured_outputs"})  # servelm's extension, as in chat (docs/structured_outputs.md)

# OpenAI fields servelm does not implement, with the values that ask for nothing (clients
# that fill in defaults send them); any other value is a 400 naming the field.
_NEUTRAL: dict[str, tuple] = {
    "include": (None, []),
    "truncation": (None, "disabled"),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_options": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),
    "context_management": (None,),
    "moderation": (None,),
    "image": (None,),
    "access_programs": (None,),
    "background_options": (None,),
}

_ROLES = ("user", "system", "developer", "assistant")
_MAX_METADATA = (16, 64, 512)  # keys, key length, value length (OpenAI's limits)

# A chat-path parameter -> the Responses field the client sent.
_CLIENT_PARAM = {"messages": "input", "prompt": "input", "max_completion_tokens":
                 "max_output_tokens", "max_tokens": "max_output_tokens",
                 "response_format": "text", "reasoning_effort": "reasoning.effort"}


def client_param(param: str | None) -> str | None:
    return _CLIENT_PARAM.get(param, param) if param else param


def check_fields(body: dict[str, Any]) -> None:
    """A 400 naming the first field servelm does not implement."""
    for name, value in body.items():
        if name in _IMPLEMENTED:
            continue
        if name not in _NEUTRAL:
            raise InvalidParameterError(f"{name[:64]} is not a Responses API field this "
                                        "server knows", param=name[:64],
                                        code="unknown_parameter")
        if value not in _NEUTRAL[name]:
            raise InvalidParameterError(f"{name} is not supported by this server",
                                        param=name, code="unsupported_parameter")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # check_fields has refused the others

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    store: StrictBool | None = None
    background: StrictBool | None = None
    stream: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # a router's affinity key (schemas.py)
    prompt_cache_retention: StrictStr | None = None  # as in chat (schemas.py)
    structured_outputs: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": null}
    thinking_token_budget: StrictInt | None = None  # servelm's extension, as in chat

    def check(self) -> None:
        if self.background and self.store is False:
            raise InvalidParameterError("background needs store (a background response is "
                                        "read back with GET)", param="background")
        if self.background and self.stream:
            raise InvalidParameterError("background with stream is not supported: poll "
                                        "GET /v1/responses/{id}", param="background",
                                        code="unsupported_parameter")
        keys, key_len, value_len = _MAX_METADATA
        meta = self.metadata or {}
        if len(meta) > keys or any(len(k) > key_len or len(v) > value_len
                                   for k, v in meta.items()):
            raise InvalidParameterError(f"metadata: at most {keys} keys of at most {key_len} "
                                        f"characters, values of at most {value_len}",
                                        param="metadata")
        self.reasoning_effort()
        self.text_format()
        self.chat_tools()
        self.chat_tool_choice()

    def reasoning_effort(self) -> str | None:
        """reasoning.effort, for chat's reasoning_effort (mapped to a thinking budget);
        summaries are not implemented."""
        reasoning = self.reasoning or {}
        for key, value in reasoning.items():
            if key not in ("effort", "summary"):
                raise InvalidParameterError(f"reasoning.{key[:32]} is not a field this "
                                            "server knows", param=f"reasoning.{key[:32]}",
                                            code="unknown_parameter")
            if key == "summary" and value is not None:
                raise InvalidParameterError("reasoning.summary is not supported by this "
                                            "server", param="reasoning.summary",
                                            code="unsupported_parameter")
        effort = reasoning.get("effort")
        if effort is not None and not isinstance(effort, str):
            raise InvalidParameterError("reasoning.effort must be a string",
                                        param="reasoning.effort")
        return effort

    def text_format(self) -> dict[str, Any] | None:
        """text.format as a chat response_format (None: free text)."""
        text = self.text or {}
        unknown = set(text) - {"format", "verbosity"}
        if unknown or text.get("verbosity") is not None:
            name = sorted(unknown)[0] if unknown else "verbosity"
            raise InvalidParameterError(f"text.{name[:64]} is not supported by this server",
                                        param="text", code="unsupported_parameter")
        fmt = text.get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise InvalidParameterError("text.format must be an object", param="text")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") != "json_schema":
            raise InvalidParameterError("text.format.type must be text, json_object or "
                                        f"json_schema; got {str(fmt.get('type'))[:64]!r}",
                                        param="text")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Function tools in the chat form; any other tool type is refused."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise InvalidParameterError(
                    f"tools[{i}]: only function tools are supported, got "
                    f"{str(tool.get('type'))[:32]!r}", param="tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                  if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidParameterError('tool_choice must be none, auto, required or '
                                        '{"type": "function", "name": ...}',
                                        param="tool_choice", code="unsupported_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}

    @property
    def is_stored(self) -> bool:
        return self.store is not False


# -- input items ------------------------------------------------------------------------------


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (input_items lists them)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not value:
        raise InvalidParameterError("input must be a non-empty string or list", param="input")
    return [_item(i, item) for i, item in enumerate(value)]


def _item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        return _message_item(i, item)
    if kind == "function_call":
        call_id, name, arguments = (_string(i, item, k) for k in ("call_id", "name",
                                                                  "arguments"))
        return {"id": item.get("id") or new_id("fc"), "type": "function_call",
                "call_id": call_id, "name": name, "arguments": arguments,
                "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = _parts_text(i, output)
        if not isinstance(output, str):
            raise InvalidParameterError(f"input[{i}].output must be a string or text parts",
                                        param="input")
        return {"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                "call_id": _string(i, item, "call_id"), "output": output,
                "status": "completed"}
    if kind == "reasoning":  # kept and listed; the model does not see it again
        return {**item, "id": item.get("id") or new_id("rs")}
    raise InvalidParameterError(f"input[{i}]: item type {str(kind)[:32]!r} is not supported "
                                "(message, function_call, function_call_output, reasoning)",
                                param="input", code="unsupported_parameter")


def _message_item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidParameterError(f"input[{i}].role must be one of {', '.join(_ROLES)}",
                                    param="input")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(i, content)
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})
    return {"id": item.get("id") or new_id("msg"), "type": "message", "role": role,
            "content": [part], "status": "completed"}


def _parts_text(i: int, parts: Any) -> str:
    if not isinstance(parts, list):
        raise InvalidParameterError(f"input[{i}].content must be a string or a list of "
                                    "parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidParameterError(f"input[{i}].content[{j}]: only input_text and "
                                        f"output_text parts are supported, got "
                                        f"{str(kind)[:32]!r}", param="input",
                                        code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidParameterError(f"input[{i}].{key} must be a string", param="input")
    return value


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items (inputs, or a response's output) as chat messages: function calls join
    the assistant message before them; reasoning is not shown to the model again."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


__all__ = ["ResponsesRequest", "chat_messages", "check_fields", "client_param",
           "input_items", "new_id"]
