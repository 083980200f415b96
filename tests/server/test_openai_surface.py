"""The rest of the OpenAI surface against a live server with the default model: logit_bias,
bad_words, allowed_token_ids, stop_token_ids, best_of, /tokenize and /detokenize, and the
400 for known OpenAI fields servelm does not implement (unknown ones are ignored)."""

from __future__ import annotations

import re

import openai
import pytest

from live_server import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _greedy(client, **extra):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     logprobs=1, **extra)


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_logit_bias_steers_and_bans(client, engine):
    plain = _greedy(client)
    top = plain.choices[0].logprobs.tokens[0]
    (top_id,) = _ids(engine, top)
    banned = _greedy(client, logit_bias={str(top_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != top
    # logprobs stay those of the model: the banned token is still reported as likely
    assert top in banned.choices[0].logprobs.top_logprobs[0]
    (banana,) = _ids(engine, " banana")
    forced = _greedy(client, logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana" * 6


@pytest.mark.parametrize("bias", [{"abc": 1}, {"5": 100.5}, {"5": -101}, {"99999999": 1},
                                  {"-3": 1}])
def test_bad_logit_bias_is_400(server, bias):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_bad_words_are_never_generated(client):
    plain = _greedy(client)
    word = plain.choices[0].text.split()[0].strip(".")
    r = _greedy(client, extra_body={"bad_words": [word]})
    assert word not in r.choices[0].text


def test_allowed_token_ids_limit_the_draw(client, engine):
    ids = _ids(engine, " banana") + _ids(engine, "!")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  seed=7, extra_body={"allowed_token_ids": ids})
    assert re.fullmatch(r"( banana|!)+", r.choices[0].text), r.choices[0].text


def test_stop_token_ids_end_the_choice(client, engine):
    plain = _greedy(client)
    second = plain.choices[0].logprobs.tokens[1]
    (stop_id,) = _ids(engine, second)
    r = _greedy(client, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == plain.choices[0].logprobs.tokens[0]


def test_best_of_returns_the_most_likely_candidates(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0,
                                  seed=11, n=2, best_of=4, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums == sorted(sums, reverse=True)
    assert r.usage.completion_tokens == 4 * 5  # every candidate is generated
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                      temperature=1.0, seed=11, n=1, best_of=4,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].logprobs is None  # not asked for
    assert alone.choices[0].text == r.choices[0].text  # same seed, same best candidate


@pytest.mark.parametrize("body,param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
])
def test_bad_best_of_is_400(server, body, param):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("field,value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("store", True),
    ("service_tier", "flex"), ("reasoning_effort", "high"), ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {}}]), ("verbosity", "low"),
])
def test_known_unimplemented_fields_are_400_naming_them(server, field, value):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_neutral_values_and_unknown_fields_are_accepted(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": False,
            "modalities": ["text"], "service_tier": "auto", "some_future_field": {"a": 1}})
    assert r.status_code == 200, r.text


def test_tokenize_matches_what_the_endpoints_count(client, server):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    with server.client() as c:
        t_chat = c.post("/tokenize", json={"messages": messages}).json()
        t_prompt = c.post("/tokenize", json={"prompt": PROMPT,
                                             "return_token_strs": True}).json()
        assert t_chat["count"] == chat.usage.prompt_tokens == len(t_chat["tokens"])
        assert t_prompt["count"] == comp.usage.prompt_tokens
        assert len(t_prompt["token_strs"]) == t_prompt["count"]
        assert t_prompt["max_model_len"] > 0
        back = c.post("/detokenize", json={"tokens": t_prompt["tokens"]}).json()
        assert back["prompt"] == PROMPT


@pytest.mark.parametrize("route,body,param", [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages"),
])
def test_bad_tokenize_requests_are_400(server, route, body, param):
    with server.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
