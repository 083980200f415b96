"""The Responses API (/v1/responses) through the official openai client against a live server
on the default model: create, retrieve, delete, input_items, previous_response_id chains,
streaming events in their documented order, background runs with polling and cancel,
function tools, text.format, reasoning items, refusals by name, the store surviving a
restart, and the OpenAI Agents SDK in its default Responses mode."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai
import pytest

from live_server import MODEL, LiveServer

TOOLS = [{"type": "function", "name": "get_weather",
          "description": "The current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False},
          "strict": True}]
FINAL = ("completed", "incomplete")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _store_url(path) -> str:
    return f"sqlite:///{path}"  # an absolute path: sqlite:////tmp/...


# First in the file: it runs its own servers on the session's engine before this module's
# shared server starts (two servers must not step one engine at once).
def test_the_store_survives_a_restart(engine, tmp_path):
    url = _store_url(tmp_path / "state.sqlite3")
    first = LiveServer(engine, state_store=url)
    try:
        r = _client(first).responses.create(model=MODEL, input="Name a colour.",
                                            max_output_tokens=8, temperature=0)
    finally:
        first.stop()
    second = LiveServer(engine, state_store=url)
    try:
        client = _client(second)
        got = client.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump()
        items = client.responses.input_items.list(r.id).data
        assert [i.content[0].text for i in items] == ["Name a colour."]
        follow = client.responses.create(model=MODEL, input="And another?",
                                         previous_response_id=r.id, max_output_tokens=4)
        assert follow.status in FINAL
        assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    finally:
        second.stop()


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return _store_url(tmp_path_factory.mktemp("responses") / "state.sqlite3")


@pytest.fixture(scope="module")
def server(engine, store_url):
    s = LiveServer(engine, state_store=store_url)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def test_create_retrieve_input_items_delete(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16,
                                temperature=0, metadata={"ticket": "42"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status in FINAL
    message = r.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and r.output_text
    assert r.output_text == message.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert r.metadata == {"ticket": "42"} and r.store is True
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id).data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", "Say hello.")]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"


def test_input_items_pages_in_both_orders(client):
    said = ["one", "two", "three"]
    r = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": said[0]},
        {"role": "assistant", "content": [{"type": "output_text", "text": said[1]}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": said[2]}]}],
        max_output_tokens=2)
    first = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == said[:2] and first.has_more
    rest = client.responses.input_items.list(r.id, after=first.data[-1].id, order="asc")
    assert [i.content[0].text for i in rest.data] == said[2:] and not rest.has_more
    newest = client.responses.input_items.list(r.id)  # OpenAI's default order: desc
    assert [i.content[0].text for i in newest.data] == said[::-1]


def test_previous_response_id_prepends_the_earlier_turn(client, server):
    """The second turn's prompt is the first turn's input and output, then the new input:
    exactly the tokens of those messages through the chat template."""
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                    instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=4)
    messages = [{"role": "user", "content": "My name is Ada. Say hi."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    with server.client() as c:
        expected = c.post("/tokenize", json={"messages": messages}).json()["count"]
    # instructions are not carried over to the next turn (as OpenAI does)
    assert second.usage.input_tokens == expected
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id).data
    assert [i.content[0].text for i in items] == ["What is my name?"]


def test_streaming_events_in_order(client):
    body = dict(model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    n = types.count("response.output_text.delta")
    assert types[4:4 + n] == ["response.output_text.delta"] * n
    final = events[-1]
    assert types[4 + n:] == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", final.type]
    assert final.type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert text == client.responses.create(**body).output_text
    stored = client.responses.retrieve(final.response.id)
    assert stored.model_dump() == final.response.model_dump()


def _wait_final(client, response_id: str, polls: int = 600):
    for _ in range(polls):
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still {r.status}")


def _wait_running(client, response_id: str, polls: int = 600) -> None:
    for _ in range(polls):
        if client.responses.retrieve(response_id).status == "in_progress":
            return
        time.sleep(0.01)
    raise AssertionError(f"{response_id} never ran")


def test_background_poll(client):
    r = client.responses.create(model=MODEL, input="Say hello.", background=True,
                                max_output_tokens=8, temperature=0)
    assert r.status == "queued" and r.background and r.output == []
    done = _wait_final(client, r.id)
    assert done.status in FINAL and done.output_text
    plain = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8,
                                    temperature=0)
    assert done.output_text == plain.output_text
    assert client.responses.cancel(r.id).status == done.status  # finished: unchanged


ABORTED = 'servelm_requests_finished_total{finish_reason="abort"}'
LONG = dict(model=MODEL, input="Write a 2000-word essay on Rome.", background=True,
            max_output_tokens=4000, temperature=0)


def test_background_cancel(client, server):
    server.wait_idle()
    aborted = server.metrics()[ABORTED]
    r = client.responses.create(**LONG)
    _wait_running(client, r.id)  # so that there is a generation to abort
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    m = server.wait_idle()  # the generation was aborted, not left to run
    assert m["servelm_num_requests_running"] == 0 and m[ABORTED] == aborted + 1
    assert client.responses.retrieve(r.id).status == "cancelled"
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(plain.id)
    assert e.value.body["param"] == "response_id"


def test_a_cancel_sent_to_another_replica_stops_the_run(engine, server, client, store_url):
    """Two replicas share the store: a cancel through one stops the run on the other (at
    its next heartbeat)."""
    other = LiveServer(engine, state_store=store_url)
    try:
        server.wait_idle()
        aborted = server.metrics()[ABORTED]
        r = client.responses.create(**LONG)
        _wait_running(_client(other), r.id)
        assert _client(other).responses.cancel(r.id).status == "cancelled"
        m = server.wait_idle()
        assert m["servelm_num_requests_running"] == 0 and m[ABORTED] == aborted + 1
        assert client.responses.retrieve(r.id).status == "cancelled"
    finally:
        other.stop()


def test_function_call_then_its_output(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=TOOLS, tool_choice="required", max_output_tokens=80,
                                parallel_tool_calls=False, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=30,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                               "output": json.dumps({"sky": "sunny", "celsius": 21})}])
    assert follow.status in FINAL and follow.output_text
    items = client.responses.input_items.list(follow.id).data
    assert [(i.type, i.call_id) for i in items] == [("function_call_output", call.call_id)]
    # the same turn without the store: the call and its output sent as input items
    stateless = client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=30, temperature=0, store=False, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": json.dumps({"sky": "sunny", "celsius": 21})}])
    assert stateless.usage.input_tokens == follow.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)


def test_function_call_streamed(client):
    events = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=TOOLS, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
        temperature=0))
    types = [e.type for e in events]
    start = types.index("response.output_item.added")
    assert events[start].item.type == "function_call"
    n = types.count("response.function_call_arguments.delta")
    assert n >= 1 and types[start + 1:] == (["response.function_call_arguments.delta"] * n + [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"])
    arguments = "".join(e.delta for e in events[start + 1:start + 1 + n])
    assert arguments == events[-3].arguments == events[-1].response.output[-1].arguments
    assert "city" in json.loads(arguments)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="Name a big city and its population, as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}}, max_output_tokens=100, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra,param", [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # no reasoning parser
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "data:,"}]}]}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "background"),
    ({"prompt_cache_key": 7}, "prompt_cache_key"),
])
def test_refused_by_name(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    with server.client() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_cache_key_is_taken_on_responses_and_chat(client):
    """A router's affinity key (docs/router.md): a replica takes it, and keeps it on the
    stored response."""
    r = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2,
                                prompt_cache_key="tenant-7")
    assert r.prompt_cache_key == "tenant-7"
    assert client.responses.retrieve(r.id).prompt_cache_key == "tenant-7"
    chat = client.chat.completions.create(model=MODEL, max_tokens=2, prompt_cache_key="k",
                                          messages=[{"role": "user", "content": "Hi."}])
    assert chat.choices[0].message is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "Hi."}], extra_body={"prompt_cache_key": ["k"]})
    assert e.value.body["param"] == "prompt_cache_key"


@pytest.fixture(scope="module")
def thinking_client(engine, tmp_path_factory):
    s = LiveServer(engine, reasoning_parser="qwen3", state_store=_store_url(
        tmp_path_factory.mktemp("thinking") / "state.sqlite3"))
    yield _client(s)
    s.stop()


def test_reasoning_item(thinking_client):
    """A `<think>` block (forced with servelm's structured_outputs; SmolLM2 does not think
    by itself) is a reasoning item before the message."""
    think = {"regex": "<think>\\n[a-z ]{5,40}\\n</think>\\n\\n[A-Z][a-z]{2,12}\\."}
    body = dict(model=MODEL, input="Name a fruit.", max_output_tokens=60, temperature=0,
                extra_body={"structured_outputs": think})
    r = thinking_client.responses.create(**body)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.strip() and "think>" not in r.output_text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(thinking_client.responses.create(stream=True, **body))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == r.output[0].content[0].text
    assert events[-1].response.output_text == r.output_text


def test_openai_agents_sdk_runs_a_function_tool(server, client):
    """The Agents SDK in its default (Responses) mode: the model must call the tool
    (tool_choice required on the first turn), the SDK runs it and sends its output back."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 C in {city}."

    sdk_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0)
    agent = Agent(name="weather", tools=[get_weather],
                  instructions="Use the weather tool, then answer in one short sentence.",
                  model=OpenAIResponsesModel(model=MODEL, openai_client=sdk_client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=400,
                                               parallel_tool_calls=False, temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(cities) >= 1 and isinstance(result.final_output, str)
    first, second = result.raw_responses[0], result.raw_responses[1]
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather"
    sent = client.responses.input_items.list(second.response_id, order="asc").data
    outputs = [i for i in sent if i.type == "function_call_output"]
    assert [o.call_id for o in outputs][:1] == [call.call_id]
    assert "sunny" in outputs[0].output
