"""A request's reasoning budget: `thinking_token_budget`, or `reasoning_effort` mapped to one.

Owns: the rule from effort to budget, the refusals by name (no reasoning parser, a bad value,
both fields at once), and the ThinkingBudget the engine enforces, whose tags are the
reasoning parser's turned into the model's token ids.
Never: counts or cuts tokens (servelm/engine/thinking_budget.py does, in the engine).

Effort -> budget, a share of the request's output limit (`max_completion_tokens`, else the
model's context length), so the answer always keeps a quarter of it or more:

    minimal, none  0       low  1/4       medium  1/2       high  3/4
"""

from __future__ import annotations

from fractions import Fraction

from servelm.parsers.reasoning_parsers import END, START, ReasoningParser
from servelm.protocol import InvalidParameterError, ThinkingBudget

EFFORT_SHARES: dict[str, Fraction] = {
    "none": Fraction(0), "minimal": Fraction(0), "low": Fraction(1, 4),
    "medium": Fraction(1, 2), "high": Fraction(3, 4)}


def effort_budget(effort: str, max_tokens: int, param: str = "reasoning_effort") -> int:
    """The thinking tokens `effort` allows out of `max_tokens` output tokens."""
    share = EFFORT_SHARES.get(effort) if isinstance(effort, str) else None
    if share is None:
        raise InvalidParameterError(f"{param} must be one of {', '.join(EFFORT_SHARES)}, got "
                                    f"{str(effort)[:32]!r}", param=param)
    return int(max_tokens * share)


def thinking_budget(tokenizer, parser: ReasoningParser | None, *, num_tokens: int | None,
                    effort: str | None, max_tokens: int) -> ThinkingBudget | None:
    """The budget a request asks for (None: none). `max_tokens`: its output limit."""
    if num_tokens is None and effort is None:
        return None
    param = "thinking_token_budget" if num_tokens is not None else "reasoning_effort"
    if num_tokens is not None and effort is not None:
        raise InvalidParameterError("thinking_token_budget and reasoning_effort cannot both "
                                    "be set", param="thinking_token_budget")
    if parser is None or tokenizer is None:
        raise InvalidParameterError(
            f"{param} needs a model that thinks: this server has no reasoning parser "
            "(--reasoning-parser)", param=param, code="unsupported_parameter")
    if num_tokens is None:
        num_tokens = effort_budget(effort, max_tokens)

    def ids(tag: str) -> list[int]:
        return list(tokenizer.encode(tag, add_special_tokens=False))

    start = [] if parser.starts_in_reasoning else ids(START)
    return ThinkingBudget(num_tokens, ids(END), start, param=param)
