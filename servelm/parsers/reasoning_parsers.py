"""Reasoning parsers: the thinking of a model that thinks in tags, apart from its answer.

Owns: one parser per convention, registered by name (`REASONING_PARSERS`, chosen by
`--reasoning-parser`), each a `split(text, final)` of the output so far into (reasoning,
content), holding back a suffix that may be the start of a tag while not final, and
`ReasoningStream`, which turns successive splits into deltas.
Never: changes the text (the two parts are exactly the output without the tags).

    qwen3        <think>reasoning</think>answer     (no <think> first: all answer)
    deepseek_r1  reasoning</think>answer            (the template opened <think>; an output
                 <think>reasoning</think>answer      that never closes it is all reasoning)
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


def _held_back(text: str, marker: str) -> str:
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


@dataclass
class Split:
    reasoning: str
    content: str
    is_reasoning_done: bool  # the end tag was seen (or there is no reasoning)


class ReasoningParser:
    name = ""
    starts_in_reasoning = False  # the prompt opened the think block

    def split(self, text: str, final: bool = True) -> Split:
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        elif not final and START.startswith(body) and body:
            return Split("", "", False)  # may still be the opening tag
        elif not self.starts_in_reasoning:
            return Split("", text, True)
        end = body.find(END)
        if end < 0:
            if not final:
                return Split(_held_back(body, END), "", False)
            if opened or self.starts_in_reasoning:
                return Split(body, "", False)
        reasoning, content = body[:end], body[end + len(END):]
        return Split(reasoning, content.lstrip("\n"), True)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (choose from: "
                         f"{', '.join(sorted(REASONING_PARSERS))})") from None


class ReasoningStream:
    """Successive texts of one streamed choice -> (reasoning delta, content so far)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.reasoning = ""

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        s = self.parser.split(text, final)
        delta = ""
        if s.reasoning.startswith(self.reasoning):
            delta = s.reasoning[len(self.reasoning):]
            self.reasoning = s.reasoning
        return delta, s.content


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "Split",
    "get_reasoning_parser",
]
