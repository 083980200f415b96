"""Tool-call parsers: a model's output text -> content and tool calls, whole or streamed.

Owns: one parser per output format, registered by name (`TOOL_PARSERS`, chosen by
`--tool-call-parser`), each a single `scan(text, final)` that reads the text so far into
the content outside calls and the calls seen (name once complete, arguments as the exact
prefix of their final JSON text). `ToolCallStream` turns successive scans into OpenAI stream
deltas (a call's id and name first, then argument fragments).
Never: tokenizes, talks to the engine, or invents arguments: a call whose arguments never
complete is content (whole text) or left as streamed (truncated stream).

    hermes / qwen   text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json     [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}
    mistral         text [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                    text [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g{...}        (newer tokenizers)
    json            {"name": "f", "arguments": {...}}  or  [{...}, ...]  (optionally fenced)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""  # a prefix of the final arguments JSON text (exact once complete)
    is_complete: bool = False


@dataclass
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _held_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a suffix that may be the start of a marker (not final yet)."""
    for k in range(min(len(text), max(map(len, markers))), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return text[:-k]
    return text


def scan_call_object(text: str, start: int) -> tuple[PartialCall, int | None]:
    """The call object at text[start] == '{': the call, and the index after it (None while
    incomplete). An object missing only its final '}' counts once its arguments are whole."""
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        obj, end = None, None
    call = PartialCall()
    m = _NAME.search(text, start, end if end is not None else len(text))
    if m is not None:
        try:
            call.name = json.loads(m.group(1))
        except json.JSONDecodeError:
            pass
    a = _ARGS.search(text, start, end if end is not None else len(text))
    args_end = None
    if a is not None:
        j = a.end()
        if j < len(text) and text[j] == '"':  # arguments sent as a JSON string
            try:
                value, args_end = _DECODER.raw_decode(text, j)
                call.arguments = value if isinstance(value, str) else json.dumps(value)
            except json.JSONDecodeError:
                pass
        else:
            try:
                _, args_end = _DECODER.raw_decode(text, j)
                call.arguments = text[j:args_end]
            except json.JSONDecodeError:
                call.arguments = text[j:].rstrip().rstrip("}").rstrip()
    elif isinstance(obj, dict):  # a call with no arguments
        call.arguments, args_end = "{}", end
    call.is_complete = call.name is not None and args_end is not None
    if end is None and call.is_complete:
        end = args_end
        k = _skip_ws(text, end)
        if k < len(text) and text[k] == "}":
            end = k + 1
    if end is not None and not call.is_complete:  # a whole object that is no call
        return call, None
    return call, end


def _scan_array(text: str, i: int, calls: list[PartialCall]) -> int | None:
    """Objects of a JSON array from text[i] == '['; the index after ']' (None: open)."""
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] == "]":
            return i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != "{":
            return None
        call, end = scan_call_object(text, i)
        calls.append(call)
        if end is None:
            return None
        i = end


class ToolParser:
    name = ""
    # How the format looks, for a system prompt when the chat template ignores `tools`.
    format_hint = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """Earlier calls written in this format (for templates that do not render them)."""
        return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content or None, calls). Calls that never completed leave the
        whole text as content."""
        scan = self.scan(text, final=True)
        if not scan.calls or not all(c.is_complete for c in scan.calls):
            return text, []
        content = scan.content.strip()
        return content or None, [ToolCall(c.name, c.arguments) for c in scan.calls]


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    format_hint = ('For each call, reply with <tool_call>{"name": <function name>, '
                   '"arguments": <arguments object>}</tool_call>')

    def render_calls(self, calls):
        return "\n".join(f"{self.START}\n" + json.dumps({"name": n, "arguments": a},
                                                          ensure_ascii=False) + f"\n{self.END}"
                         for n, a in calls)

    def scan(self, text: str, final: bool) -> Scan:
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail if final else _held_back(tail, (self.START,)))
                break
            content.append(text[pos:i])
            j = _skip_ws(text, i + len(self.START))
            if j >= len(text):
                calls.append(PartialCall())
                break
            if text[j] != "{":  # not a call after all
                content.append(text[i:j])
                pos = j
                continue
            call, end = scan_call_object(text, j)
            calls.append(call)
            if end is None:
                break
            k = text.find(self.END, end)
            if k < 0:
                rest = text[end:].lstrip()
                if not final and self.END.startswith(rest[:len(self.END)]):
                    break  # the close tag may still come
                pos = end  # a missing close tag: the call is whole, what follows is content
                continue
            pos = k + len(self.END)
        return _scan(content, calls, final)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    format_hint = ('To call functions, reply only with {"name": <function name>, '
                   '"parameters": <arguments object>}, several separated by ";"')
    _START = re.compile(r'<\|python_tag\|>|\{\s*"name"')

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.lstrip()
        m = self._START.search(text)
        if m is None:
            if not final and (stripped.startswith("{") or self.TAG.startswith(stripped)):
                return Scan("")
            tail = text if final else _held_back(text, (self.TAG, '{"name"', "{"))
            return Scan(tail)
        content = text[:m.start()]
        i = m.end() if m.group(0) == self.TAG else m.start()
        calls: list[PartialCall] = []
        while True:
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ";":
                i += 1
                continue
            if i >= len(text) or text[i] != "{":
                break
            call, end = scan_call_object(text, i)
            calls.append(call)
            if end is None:
                break
            i = end
        return _scan([content], calls, final)


class MistralToolParser(ToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    format_hint = ('To call functions, reply with [TOOL_CALLS][{"name": <function name>, '
                   '"arguments": <arguments object>}, ...]')

    def render_calls(self, calls):
        return self.TAG + super().render_calls(calls)

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(self.TAG)
        if i < 0:
            return Scan(text if final else _held_back(text, (self.TAG,)))
        content, calls = text[:i], []
        while i >= 0:
            j = _skip_ws(text, i + len(self.TAG))
            if j < len(text) and text[j] == "[":
                _scan_array(text, j, calls)
                break
            if j >= len(text):
                break
            brace = text.find("{", j)
            head = text[j:brace] if brace >= 0 else text[j:]
            name = head.replace(self.ARGS, "").strip()
            if brace < 0:
                calls.append(PartialCall())
                break
            try:
                _, end = _DECODER.raw_decode(text, brace)
                calls.append(PartialCall(name, text[brace:end], bool(name)))
            except json.JSONDecodeError:
                calls.append(PartialCall(name or None, text[brace:].rstrip()))
                break
            i = text.find(self.TAG, end)
        return _scan([content], calls, final)


class JsonToolParser(ToolParser):
    """A JSON call object or array of them, alone or after text; what `tool_choice`
    required / a named function constrains the output to."""

    name = "json"
    format_hint = ('To call functions, reply only with a JSON list of '
                   '{"name": <function name>, "arguments": <arguments object>}')
    _START = re.compile(r'```(?:json)?\s*(?=[\[{])|\[\s*(?=\{)|\{\s*"name"')

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.lstrip()
        m = self._START.search(text)
        if m is None:
            if not final and (not stripped or stripped[0] in "[{`"):
                return Scan("")
            return Scan(text if final else _held_back(text, ("```", "[", "{")))
        content = text[:m.start()]
        i = m.end() if m.group(0).startswith("```") else m.start()
        calls: list[PartialCall] = []
        if i < len(text) and text[i] == "[":
            _scan_array(text, i, calls)
        elif i < len(text):
            calls.append(scan_call_object(text, i)[0])
        return _scan([content], calls, final)


def _scan(content: list[str], calls: list[PartialCall], final: bool) -> Scan:
    text = "".join(content)
    if calls or not final:
        text = text.rstrip()  # whitespace before a call (or maybe one) is not content
    return Scan(text, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        JsonToolParser)}
TOOL_PARSERS["qwen"] = HermesToolParser  # Qwen 2.5 / 3 use the Hermes format


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (choose from: "
                         f"{', '.join(sorted(TOOL_PARSERS))})") from None


class ToolCallStream:
    """Successive texts of one streamed choice -> OpenAI deltas: content, then for each call
    {"index", "id", "type", "function": {"name", "arguments": ""}} once its name is known,
    then {"index", "function": {"arguments": fragment}} as its arguments grow."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.content = ""  # sent so far
        self.ids: list[str] = []
        self.args: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for the whole text so far."""
        scan = self.parser.scan(text, final)
        content = ""
        if scan.content.startswith(self.content):
            content = scan.content[len(self.content):]
            self.content = scan.content
        deltas = []
        calls = scan.calls[:self.max_calls] if self.max_calls else scan.calls
        for i, call in enumerate(calls):
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self.args.append("")
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append({"index": i, "function": {
                    "arguments": call.arguments[len(sent):]}})
                self.args[i] = call.arguments
        return content, deltas


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "JsonToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PartialCall",
    "Scan",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "new_call_id",
    "scan_call_object",
]
