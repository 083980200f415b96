"""Reasoning budgets through the official openai client against a live server:
thinking_token_budget and reasoning_effort on chat completions, reasoning.effort on
responses; the engine closes the thinking with the parser's end tag once the budget is spent,
usage and /metrics count the reasoning tokens, and bad values are refused by name.

SmolLM2 never writes `</think>` by itself, so under deepseek_r1 (the prompt opened the
thinking) every output token is thinking until the engine forces the end tag."""

from __future__ import annotations

import openai
import pytest

from live_server import MODEL, LiveServer

ASK = [{"role": "user", "content": "Name a fruit."}]
END = "</think>"


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# First in the file: its own server on the session's engine, stopped before the module's
# thinking server starts (two servers must not step one engine at once).
def test_a_model_without_a_reasoning_parser_refuses_budgets_by_name(engine):
    s = LiveServer(engine)
    try:
        client = _client(s)
        for extra, param in [({"thinking_token_budget": 5}, "thinking_token_budget"),
                             ({"reasoning_effort": "low"}, "reasoning_effort")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                               extra_body=extra)
            assert e.value.body["param"] == param
            assert e.value.body["code"] == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4,
                                    reasoning={"effort": "high"})
        assert e.value.body["param"] == "reasoning.effort"
    finally:
        s.stop()


@pytest.fixture(scope="module")
def thinking(engine):
    s = LiveServer(engine, reasoning_parser="deepseek_r1")
    yield s
    s.stop()


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                          temperature=0, logprobs=True, **kwargs)


def _tokens(r) -> list[str]:
    return [t.token for t in r.choices[0].logprobs.content]


def test_a_spent_budget_forces_the_end_tag_then_the_answer_goes_on(thinking):
    client = _client(thinking)
    free = _chat(client)
    assert END not in "".join(_tokens(free))  # the model never closes it by itself
    r = _chat(client, extra_body={"thinking_token_budget": 5})
    tokens, free_tokens = _tokens(r), _tokens(free)
    assert tokens[:5] == free_tokens[:5]  # the thinking, as sampled
    assert tokens[5] != free_tokens[5] and "".join(tokens[5:8]) == END  # then forced
    assert len(tokens) > 8  # the answer continues after the tag
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "".join(free_tokens[:5])
    assert msg.content and END not in msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 8  # the tag included
    assert free.usage.completion_tokens_details.reasoning_tokens == free.usage.completion_tokens


def test_effort_maps_to_a_share_of_the_output_limit(thinking):
    client = _client(thinking)
    budget = _chat(client, extra_body={"thinking_token_budget": 5})
    low = _chat(client, reasoning_effort="low")  # 20 // 4 = 5 thinking tokens
    assert _tokens(low) == _tokens(budget)
    minimal = _chat(client, reasoning_effort="minimal")
    assert "".join(_tokens(minimal)[:3]) == END
    # an empty thinking block is no reasoning (usage counts what the parser reads as such)
    assert not minimal.choices[0].message.model_extra.get("reasoning_content")
    assert minimal.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_effort_is_a_budget(thinking):
    client = _client(thinking)
    before = thinking.metrics().get("servelm_reasoning_tokens_total", 0.0)
    r = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=20,
                                temperature=0, reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    assert r.reasoning.effort == "low"
    b = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=20,
                                temperature=0, extra_body={"thinking_token_budget": 5})
    assert b.output_text == r.output_text
    after = thinking.metrics()["servelm_reasoning_tokens_total"]
    assert after - before == 16


@pytest.mark.parametrize("extra,param", [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": "5"}, "thinking_token_budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_token_budget": 5, "reasoning_effort": "low"}, "thinking_token_budget"),
])
def test_bad_budgets_are_refused_by_name(thinking, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _client(thinking).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                  extra_body=extra)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("reasoning,param", [
    ({"effort": "extreme"}, "reasoning.effort"),
    ({"summary": "auto"}, "reasoning.summary"),
    ({"effort": "low", "colour": 1}, "reasoning.colour"),
])
def test_bad_responses_reasoning_is_refused_by_name(thinking, reasoning, param):
    with pytest.raises(openai.BadRequestError) as e:
        _client(thinking).responses.create(model=MODEL, input="Hi.", max_output_tokens=4,
                                           extra_body={"reasoning": reasoning})
    assert e.value.body["param"] == param
