"""What one client may take: prompts per request, header sizes, prefix-cache namespaces; and
fields that were accepted or refused wrongly (negative seeds, logprob bytes)."""

from __future__ import annotations

import json

import openai
import pytest
from live_server import MODEL, LiveServer

from servelm.server.formatting import ChatFormatter


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, max_prompts=8, max_choices=12)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_prompts_beyond_the_cap_are_a_400_naming_prompt(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["Hi"] * 9, max_tokens=1)
    assert info.value.body["param"] == "prompt"
    assert info.value.body["code"] == "too_many_prompts"
    r = client.completions.create(model=MODEL, prompt=["Hi"] * 8, max_tokens=1)
    assert len(r.choices) == 8


def test_choices_beyond_the_cap_are_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["Hi"] * 4, n=4, max_tokens=1)
    assert info.value.body["param"] == "n"
    assert info.value.body["code"] == "too_many_choices"
    r = client.completions.create(model=MODEL, prompt=["Hi"] * 4, n=3, max_tokens=1)
    assert len(r.choices) == 12


def test_timing_header_is_a_summary_whatever_the_number_of_prompts(client):
    one = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    many = client.completions.with_raw_response.create(
        model=MODEL, prompt=[f"Say {i}" for i in range(8)], max_tokens=2)
    one_h, many_h = one.headers["x-servelm-timing"], many.headers["x-servelm-timing"]
    summary = json.loads(many_h)
    assert isinstance(summary, dict) and summary["num_prompts"] == 8
    assert summary["completion_tokens"] == 16
    assert summary["prompt_tokens"] == many.parse().usage.prompt_tokens
    assert summary["e2e_s"] > 0  # the slowest prompt's
    # bounded: one key more than a single prompt's breakdown, not one breakdown per prompt
    assert len(many_h) < len(one_h) + 64
    assert set(summary) == set(json.loads(one_h)) | {"num_prompts"}


def test_negative_seed_is_accepted_and_deterministic(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=-12345, **kw).choices[0].text
    b = client.completions.create(seed=-12345, **kw).choices[0].text
    c = client.completions.create(seed=-(2**63), **kw)
    assert a == b and c.choices[0].text


def test_chat_logprob_bytes_are_each_tokens_own_bytes(engine):
    """A token holding part of a multi-byte character reports its own bytes, not U+FFFD's;
    the bytes of a text's tokens join to its UTF-8 encoding."""
    tok = engine.tokenizer
    text = "naïve 😀 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    fmt = ChatFormatter(tok, "chatcmpl-x", MODEL, 1, want_logprobs=True)
    entries = [fmt._entry(t, -0.5) for t in ids]
    assert any(e["token"] == "\ufffd" for e in entries)  # the text has split characters
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode("utf-8")
    assert all(e["bytes"] != list("\ufffd".encode()) for e in entries)


def test_chat_logprob_bytes_join_to_the_reply(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write: café, naïve, 日本"}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
    assert joined.decode("utf-8") == choice.message.content
    for t in choice.logprobs.content:
        assert all(alt.bytes is not None for alt in t.top_logprobs)


def test_a_salt_per_request_keeps_prefix_cache_bookkeeping_bounded(server, client):
    for i in range(40):
        client.completions.create(model=MODEL, prompt="Tell me a story about a dragon " * 6,
                                  max_tokens=1, extra_body={"cache_salt": f"t{i}-" + "s" * 200})
    m = server.metrics()
    total = m["servelm_kv_blocks_total"]
    assert 1 <= m["servelm_prefix_cache_namespaces"] <= 40 + 1  # and the unsalted one
    assert m["servelm_prefix_cache_bookkeeping_bytes"] > 0
    # bounded by the pool (a few hundred bytes per block), however many salts come
    assert m["servelm_prefix_cache_bookkeeping_bytes"] < total * 2048
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"cache_salt": "s" * 257})
    assert info.value.body["param"] == "cache_salt"
