"""Tool-call parsers against outputs in the formats real models write (Hermes 2 Pro / Qwen
2.5, Llama 3.1, Mistral v3 and v11 tokenizers, plain JSON), including the broken ones other
engines shipped bugs for: a missing `}`, text before the call, several calls, a call split
across stream chunks at every possible point, and a truncated call."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.parsers import ToolCallStream, get_tool_parser

WEATHER = '{"city": "Paris", "unit": "celsius"}'

# (parser, output, expected content, expected [(name, arguments JSON)])
RECORDED = [
    # Qwen2.5-7B-Instruct / Hermes-2-Pro: one call, the template's newlines kept
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    # text before the call
    ("hermes", "I'll look that up for you.\n<tool_call>\n"
     f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "I'll look that up for you.", [("get_weather", WEATHER)]),
    # several calls, one with a brace inside a string
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "a } b"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("search", '{"q": "a } b"}'), ("get_time", "{}")]),
    # the missing final "}" (seen from small Qwen models)
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'
     '</tool_call>', None, [("get_weather", '{"city": "Paris"}')]),
    # a missing close tag, and text after the call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}', None,
     [("f", '{"x": [1, 2]}')]),
    # no call at all; a tag with no JSON is content
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    # Llama 3.1 with the python tag, two calls separated by ";"
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "CET"}}', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    # Llama 3.2 without the tag, and with text first
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", 'Let me check. {"name": "get_weather", "parameters": {"city": "Paris"}}',
     "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", "Use {curly} braces in f-strings.", "Use {curly} braces in f-strings.", []),
    # Mistral 7B v0.3: an array after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    # Mistral v11 tokenizer (Mistral Small 3.2): name[ARGS]{...}, repeated
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[ARGS]{}', "Sure.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    # plain JSON, fenced and not, and arguments sent as a JSON string
    ("json", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("json", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("json", '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None,
     [("get_weather", '{"city": "Paris"}')]),
]


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_whole_output(name, text, content, calls):
    got_content, got = get_tool_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        json.loads(c.arguments)
        assert c.id.startswith("call_")


def _stream(name: str, pieces: list[str]):
    s = ToolCallStream(get_tool_parser(name))
    content, names, args, ids, order = "", {}, {}, {}, []
    text = ""
    for k, piece in enumerate(pieces + [""]):
        text += piece
        c, deltas = s.update(text, final=k == len(pieces))
        content += c
        for d in deltas:
            i = d["index"]
            if "id" in d:
                assert i not in names, "a call starts once"
                names[i], ids[i] = d["function"]["name"], d["id"]
                assert d["function"]["arguments"] == ""  # the id and name come first
            else:
                assert i in names, "arguments only after the call's name"
            args[i] = args.get(i, "") + d["function"]["arguments"]
            order.append(i)
    assert order == sorted(order), "calls stream one after another"
    return content, [(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_streamed_char_by_char_equals_whole(name, text, content, calls):
    got_content, got = _stream(name, list(text))
    assert got == calls
    assert (got_content.strip() or None) == content


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_same_calls(data):
    name, text, content, calls = data.draw(st.sampled_from(RECORDED))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    got_content, got = _stream(name, pieces)
    assert got == calls and (got_content.strip() or None) == content


def test_a_tag_split_across_chunks_is_never_content():
    content, calls = _stream("hermes", ["Hi <tool", "_ca", 'll>{"name": "f", "argu',
                                        'ments": {"a": 1}}</tool_', "call>"])
    assert content.strip() == "Hi" and calls == [("f", '{"a": 1}')]


def test_a_truncated_call_is_content_when_whole_and_partial_when_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = get_tool_parser("hermes").parse(text)
    assert content == text and calls == []
    _, streamed = _stream("hermes", list(text))
    assert streamed == [("get_weather", '{"city": "Par')]  # what was generated, no more


def test_one_call_when_parallel_calls_are_off():
    s = ToolCallStream(get_tool_parser("hermes"), max_calls=1)
    text = RECORDED[2][1]
    _, deltas = s.update(text, final=True)
    assert {d["index"] for d in deltas} == {0}


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "json"])
def test_rendered_calls_parse_back(name):
    p = get_tool_parser(name)
    text = p.render_calls([("f", {"a": 1}), ("g", {})])
    assert [(c.name, json.loads(c.arguments)) for c in p.parse(text)[1]] == \
        [("f", {"a": 1}), ("g", {})]
