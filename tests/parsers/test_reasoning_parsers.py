"""Reasoning parsers on outputs as Qwen3 and DeepSeek-R1 write them, whole and streamed."""

from __future__ import annotations

import pytest

from servelm.parsers import ReasoningStream, get_reasoning_parser

CASES = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4", "\nThe user wants 2+2.\n", "4"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "\n\n", "Hello!"),  # thinking switched off
    ("qwen3", "Just an answer.", "", "Just an answer."),
    ("qwen3", "<think>still thinking when max_tokens hit", "still thinking when max_tokens hit",
     ""),
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.\n",
     "The answer is 4."),
    ("deepseek_r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "no end tag ever", "no end tag ever", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole(name, text, reasoning, content):
    s = get_reasoning_parser(name).split(text, final=True)
    assert (s.reasoning, s.content) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_streamed_char_by_char(name, text, reasoning, content):
    stream = ReasoningStream(get_reasoning_parser(name))
    thought, sent = "", ""
    for k in range(1, len(text) + 1):
        delta, now = stream.update(text[:k])
        thought += delta
        assert "<think>" not in thought and "</think>" not in now
        assert now.startswith(sent) or not sent
        sent = now
    delta, now = stream.update(text, final=True)
    assert thought + delta == reasoning and now == content
