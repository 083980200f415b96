"""prompt_cache_retention through the official openai client against a live server whose KV
pool is small: a prompt sent with "24h" is still cached after pressure that evicts one sent
without it (usage's cached_tokens on the follow-up), it counts against its OpenAI-Project,
and bad values are refused by name."""

from __future__ import annotations

import openai
import pytest

from live_server import MODEL, LiveServer

BLOCK = 16


@pytest.fixture(scope="module")
def small_pool(default_model_path):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    engine = build_engine(EngineArgs(model=MODEL, num_blocks=48, max_num_seqs=4,
                                     dtype="float32", max_retained_blocks=16))
    s = LiveServer(engine)
    s.engine = engine
    yield s
    s.stop()


def _text(topic: str, num_words: int = 90) -> str:
    return " ".join(f"{topic}{i % 7}" for i in range(num_words))


def _cached(client, prompt: str, retention: str | None = None):
    extra = {"prompt_cache_retention": retention} if retention else {}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def test_a_retained_prefix_survives_pressure_that_evicts_an_unretained_one(small_pool):
    client = openai.OpenAI(base_url=small_pool.url + "/v1", api_key="unused", max_retries=0)
    kept, lost = "Kept: " + _text("alpha"), "Lost: " + _text("beta")
    _cached(client, kept, "24h")
    _cached(client, lost, "in_memory")
    for i in range(8):  # distinct prompts that need more blocks than the pool has free
        _cached(client, f"Other {i}: " + _text(f"gamma{i}x", 120))
    num_cached, num_prompt = _cached(client, kept)
    assert num_cached == (num_prompt - 1) // BLOCK * BLOCK > 0
    assert _cached(client, lost)[0] == 0


def test_retention_counts_against_the_openai_project(small_pool):
    """The OpenAI-Project header is the tenant whose cap a retention counts in."""
    cache = small_pool.engine.block_manager.prefix_cache
    client = openai.OpenAI(base_url=small_pool.url + "/v1", api_key="unused", max_retries=0,
                           project="acme")
    _, num_prompt = _cached(client, "Acme: " + _text("delta", 40), "24h")
    assert cache.num_retained_by("project:acme") == num_prompt // BLOCK > 0
    bad = openai.OpenAI(base_url=small_pool.url + "/v1", api_key="unused", max_retries=0,
                        project="x" * 129)
    with pytest.raises(openai.BadRequestError) as e:
        _cached(bad, "Hi.", "24h")
    assert e.value.body["param"] == "OpenAI-Project"


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_retention_is_taken_and_bad_values_refused_by_name(small_pool, endpoint):
    client = openai.OpenAI(base_url=small_pool.url + "/v1", api_key="unused", max_retries=0)

    def send(value):
        if endpoint == "chat":
            return client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi."}],
                extra_body={"prompt_cache_retention": value})
        return client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2,
                                       extra_body={"prompt_cache_retention": value})

    assert send("24h") is not None
    with pytest.raises(openai.BadRequestError) as e:
        send("1h")
    assert e.value.body["param"] == "prompt_cache_retention"
