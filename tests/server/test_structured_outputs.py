"""Structured outputs over HTTP with the official openai client and the default model:
response_format json_object / json_schema (pydantic models through `parse`), servelm's
structured_outputs extension (regex, choice, grammar), and the errors of bad specs."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from live_server import MODEL

ASK = [{"role": "user", "content": "Describe a person (name and age) as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


class Person(BaseModel):
    name: str
    age: int


class Team(BaseModel):
    title: str
    members: list[Person]
    is_active: bool


@pytest.mark.parametrize("model", [Person, Team])
def test_parse_returns_a_validated_pydantic_object(client, model):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=model,
                                      max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_a_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                       temperature=0.8, seed=3, n=2,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_max_tokens_mid_structure_is_length(client):
    with pytest.raises(openai.LengthFinishReasonError) as exc:  # the client's own check
        client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Team,
                                      max_tokens=5, temperature=0)
    r = exc.value.completion
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_streamed_sampled_choices_follow_the_regex(client):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    stream = client.completions.create(
        model=MODEL, prompt="A product code:", max_tokens=20, temperature=1.0, n=3,
        stream=True, extra_body={"structured_outputs": {"regex": pattern}})
    texts: dict[int, str] = {}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2]
    for i, text in texts.items():
        assert finish[i] == "stop" and re.fullmatch(pattern, text), (i, text)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0}, {"temperature": 1.2, "top_p": 0.9}, {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.8, "min_p": 0.1, "repetition_penalty": 1.3},
    {"temperature": 0.7, "presence_penalty": 1.5, "frequency_penalty": 1.0, "seed": 9},
])
def test_every_sampling_mode_stays_in_the_grammar(client, sampling):
    pattern = r"(yes|no), because [a-z]{2,8}( [a-z]{2,8}){0,3}\."
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:",
                                  max_tokens=40, extra_body={
                                      "structured_outputs": {"regex": pattern}, **sampling})
    c = r.choices[0]
    assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (sampling, c.text)


def test_choice_and_grammars(client):
    choices = ["positive", "negative", "neutral"]
    for extra, check in [
        ({"choice": choices}, lambda t: t in choices),
        ({"grammar": 'start: "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
        ({"grammar": 'root ::= [1-9] [0-9]? " apples"'},
         lambda t: re.fullmatch(r"[1-9][0-9]? apples", t)),
    ]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "The movie was great!"}],
            max_tokens=12, temperature=0.7, seed=1, extra_body={"structured_outputs": extra})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and check(text), (extra, text)


def test_prefix_cached_repeat_gives_the_same_structured_output(client, server):
    body = dict(model=MODEL, messages=ASK, response_format=Person, max_tokens=80,
                temperature=0)
    first = client.chat.completions.parse(**body)
    again = client.chat.completions.parse(**body)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.parsed == first.choices[0].message.parsed


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "strict": True,
                                          "schema": {"type": "frobnicate"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "strict": True,
                                          "schema": {"not": {"type": "string"}}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_specs_are_400_naming_the_field(server, body, param):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # nothing else is affected: the next request is served
    with server.client() as c:
        ok = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_non_strict_schema_ignores_what_the_library_lacks(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "p", "strict": False,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}},
                       "required": ["name"], "not": {"required": ["x"]}}}})
    assert r.choices[0].finish_reason == "stop"
    assert "name" in json.loads(r.choices[0].message.content)


# -- property: every completed output validates against its schema ---------------------------

_LEAVES = st.sampled_from([
    {"type": "integer"}, {"type": "boolean"}, {"type": "string", "maxLength": 6},
    {"enum": ["a", "b", "c"]}, {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
])
_NAMES = st.lists(st.sampled_from(["id", "ok", "tag", "n", "x"]), min_size=1, max_size=3,
                  unique=True)


@st.composite
def small_schemas(draw):
    names = draw(_NAMES)
    props = {n: draw(_LEAVES) for n in names}
    return {"type": "object", "properties": props, "required": names,
            "additionalProperties": False}


_COMPLETED: list[int] = []


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=small_schemas(), seed=st.integers(0, 2**16))
def test_every_completed_output_validates(client, schema, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Fill in the JSON."}],
        max_tokens=48, temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "s", "strict": True, "schema": schema}})
    c = r.choices[0]
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.message.content), schema)
        _COMPLETED.append(1)
    else:
        assert c.finish_reason == "length"


def test_the_property_saw_completed_outputs():
    assert _COMPLETED, "no random-schema request completed within max_tokens"
