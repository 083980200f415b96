"""Tool calling and reasoning output through the official openai client with the default
model: a full round trip (call -> tool result -> answer), streamed and not; tool_choice
none / auto / required / named; validation; `<think>` output read by a reasoning parser."""

from __future__ import annotations

import json

import openai
import pytest

from live_server import MODEL, LiveServer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
        "strict": True}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                       "required": ["tz"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _streamed(stream):
    """(content, reasoning, [(id, name, arguments)], finish_reason) of a one-choice stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(client, stream):
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        _, _, calls, finish = _streamed(client.chat.completions.create(stream=True, **body))
    else:
        r = client.chat.completions.create(**body)
        msg = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls]
        finish = r.choices[0].finish_reason
    assert finish == "stop"  # OpenAI's for a named tool_choice
    assert len(calls) == 1
    call_id, name, arguments = calls[0]
    assert name == "get_weather" and call_id.startswith("call_")
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id,
         "content": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21})}]
    body = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                max_tokens=40, temperature=0)
    if stream:
        content, _, calls, _ = _streamed(client.chat.completions.create(stream=True, **body))
    else:
        final = client.chat.completions.create(**body)
        content, calls = final.choices[0].message.content, final.choices[0].message.tool_calls
    assert content and not calls


def test_required_calls_any_tool_with_arguments_that_parse(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=80, temperature=0.8, seed=5, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)


def test_the_template_sees_the_tools(client, server):
    """SmolLM2's template ignores `tools`: they reach the model in a system message."""
    with server.client() as c:
        with_tools = c.post("/tokenize", json={"messages": ASK}).json()["count"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > with_tools + 40
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == with_tools


def test_auto_reads_calls_in_the_parsers_format(client):
    """auto: whatever the model writes in the Hermes format is a call (forced here with a
    grammar, as this small model seldom calls tools by itself)."""
    grammar = ('start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"" CITY "\\"}}\\n</tool_call>"\nCITY: /[A-Z][a-z]{2,8}/')
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                extra_body={"structured_outputs": {"grammar": grammar}})
    r = client.chat.completions.create(**body)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get_weather"
    content, _, calls, finish = _streamed(client.chat.completions.create(stream=True, **body))
    assert finish == "tool_calls" and not content.strip()
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments)
                                             for t in c.message.tool_calls]


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400(server, body, param):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def thinking_server(engine):
    s = LiveServer(engine, reasoning_parser="qwen3")
    yield s
    s.stop()


THINK = {"regex": "<think>\\n[a-z ]{5,40}\\n</think>\\n\\n[A-Z][a-z]{2,12}\\."}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_apart_from_the_answer(thinking_server, stream):
    """A `<think>` block (forced with a regex; SmolLM2 does not think by itself) is
    reasoning_content; max_tokens counts it, and usage reports its tokens."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused",
                           max_retries=0)
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=60, temperature=0, extra_body={"structured_outputs": THINK})
    if stream:
        content, reasoning, _, finish = _streamed(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **body))
    else:
        r = client.chat.completions.create(**body)
        msg = r.choices[0].message
        content, reasoning = msg.content, msg.model_extra["reasoning_content"]
        finish = r.choices[0].finish_reason
        details = r.usage.completion_tokens_details
        assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    assert finish == "stop"
    assert "<think>" not in content and "</think>" not in content and content.endswith(".")
    assert reasoning.strip() and "think>" not in reasoning
    short = client.chat.completions.create(**{**body, "max_tokens": 4})
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == ""  # all four tokens were thinking
    assert short.usage.completion_tokens_details.reasoning_tokens == 4
