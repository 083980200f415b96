"""Rendering a model's Jinja chat template into a prompt string.

Owns: checking chat messages, and rendering a template the way transformers'
`apply_chat_template` does (sandboxed Jinja, trim_blocks + lstrip_blocks, the same helper
names), so a prompt here equals the one the model was tuned with.

Never: tokenizes, or runs a template outside the sandbox (a template comes from a model file,
which is untrusted input).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from servelm.protocol import InvalidParameterError

__all__ = ["render_chat_template", "validate_messages"]


def validate_messages(messages: Any) -> None:
    """Raise InvalidParameterError(param="messages") unless `messages` is a usable chat."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParameterError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParameterError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidParameterError(
                f"messages[{i}] needs a non-empty string 'role'", param="messages"
            )
        if "content" not in message:
            raise InvalidParameterError(f"messages[{i}] has no 'content'", param="messages")
        if not isinstance(message["content"], str):
            raise InvalidParameterError(
                f"messages[{i}].content must be a string, got {type(message['content']).__name__}",
                param="messages",
            )


class _TemplateRaised(Exception):
    """Raised by a template's own `raise_exception(...)`: the chat breaks its rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes HTML characters; chat templates expect plain JSON,
    # which is what transformers installs too.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    # jinja2 on first use: the engine core holds a tokenizer but never renders a template,
    # and importing jinja2 is 0.17 s of its start-up.
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template`; bad messages raise InvalidParameterError."""
    validate_messages(messages)
    try:
        return _compile(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except _TemplateRaised as exc:
        # The template rejected this conversation (e.g. roles out of order): the caller's fault.
        raise InvalidParameterError(
            f"chat template rejected messages: {exc}", param="messages"
        ) from exc
