"""Tools in the prompt: what a chat template gets when a request carries tools.

Owns: passing `tools` to a chat template that reads them (as transformers does), and for a
template that does not (it never mentions `tools` / `tool_calls`): the tools described in a
system message in the tool parser's own format, and earlier assistant calls written into
their content in that format, so the model sees the same convention it is asked to produce.
Never: renders the template itself (the tokenizer does), or parses output.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.meta

from servelm.parsers.tool_parsers import ToolParser


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """Names a template reads from its context (jinja2's own analysis, not a text search)."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def _variables_read(template: str) -> frozenset[str]:
    """Context variables plus attribute names the template reads (`message.tool_calls`)."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    attrs = {n.attr for n in ast.find_all(jinja2.nodes.Getattr)}
    attrs |= {n.arg.value for n in ast.find_all(jinja2.nodes.Getitem)
              if isinstance(n.arg, jinja2.nodes.Const) and isinstance(n.arg.value, str)}
    return template_variables(template) | frozenset(attrs)


def tool_prompt(template: str | None, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, parser: ToolParser
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a chat with `tools` (None: no tools)."""
    read = _variables_read(template or "")
    extra: dict[str, Any] = {}
    if tools and "tools" in read:
        extra["tools"] = tools
    elif tools:
        messages = _with_tool_system_prompt(messages, tools, parser)
    if "tool_calls" not in read:
        messages = [_calls_as_content(m, parser) for m in messages]
    return messages, extra


def _with_tool_system_prompt(messages, tools, parser: ToolParser):
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = (f"You can call these functions:\n{lines}\n{parser.format_hint}, or answer "
            "directly when no function is needed.")
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _calls_as_content(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = parser.render_calls([(c["function"]["name"], c["function"]["arguments"])
                                   for c in calls])
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{written}" if content else written
    return out


__all__ = ["template_variables", "tool_prompt"]
