"""The official openai client against a live server with the default model."""

from __future__ import annotations

import openai
import pytest

from live_server import MODEL


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts, chunks


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_counts_usage(client, engine):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_uses_the_chat_template(client, engine):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_shape_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    texts, chunks = _stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 8
    assert chunks.index(finish[0]) == len(chunks) - 2  # finish chunk, then the usage chunk
    timing = usage.model_extra["timing"]
    assert timing["completion_tokens"] == 8 and timing["ttft_s"] > 0
    assert len({c.id for c in chunks}) == 1
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "Name a color."}],
                                       max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert texts[0] == r.choices[0].message.content


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                            temperature=0, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("prompt", [
    "Emoji for happy: 😀, sad: 😢, angry:",  # emits emoji (4-byte UTF-8, split over tokens)
    "Translate to Chinese: thank you =",  # emits CJK
])
def test_streamed_text_equals_non_streamed_text(client, prompt):
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    assert any(ord(ch) > 0x2E80 for ch in full), f"prompt no longer makes non-ASCII: {full!r}"
    texts, _ = _stream_text(client.completions.create(stream=True, **kwargs))
    assert texts[0] == full
    assert "\ufffd" not in full


def test_echo_returns_the_prompt_exactly(client):
    prompt = "naïve café 😀 你好 —"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith(prompt)
    texts, _ = _stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                                      temperature=0, echo=True, stream=True))
    assert texts[0] == r.choices[0].text


def test_n2_gives_two_choices(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 10
    texts, _ = _stream_text(client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, n=2, temperature=1.0, seed=7,
        stream=True, extra_body={"ignore_eos": True}))
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}


def test_several_prompts_and_token_ids(client, engine):
    ids = engine.tokenizer.encode("Hello")
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=2, n=2,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, logprobs=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the best one


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string_is_not_emitted(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 7", "zzz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == " 5, 6,"
    texts, _ = _stream_text(client.completions.create(model=MODEL, prompt="1, 2, 3, 4,",
                                                      max_tokens=20, temperature=0,
                                                      stop=[" 7", "zzz"], stream=True))
    assert texts[0] == " 5, 6,"


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0,
                  top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # the seed matters


def test_sampling_extensions_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
                    "cache_salt": "tenant-a"})
    assert r.usage.completion_tokens == 4
