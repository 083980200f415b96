"""What is computed over the prompt: prompt logprobs (completions' echo with logprobs) and
/v1/embeddings (pooled final hidden states), against a live server with the default model,
and the same numbers with chunked prefill and a warm prefix cache."""

from __future__ import annotations

import math

import openai
import pytest

from live_server import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_prompt_logprobs_equal_the_logprobs_of_generating_those_tokens(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    gen = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = gen.choices[0].logprobs
    generated = engine.tokenizer.encode(gen.choices[0].text, add_special_tokens=False)
    assert len(generated) == 5
    for _ in range(2):  # the second time, the prompt is in the prefix cache
        echo = client.completions.create(model=MODEL, prompt=ids + generated, max_tokens=1,
                                         temperature=0, logprobs=2, echo=True)
        e = echo.choices[0].logprobs
        n = len(ids) + len(generated)
        assert "".join(e.tokens[:n]) == PROMPT + gen.choices[0].text
        assert e.token_logprobs[0] is None and e.top_logprobs[0] is None
        for got, want in zip(e.token_logprobs[len(ids):n], lp.token_logprobs):
            assert math.isclose(got, want, abs_tol=2e-3), (got, want)
        assert set(e.top_logprobs[len(ids)]) == set(lp.top_logprobs[0])
        assert e.text_offset[0] == 0 and echo.choices[0].text.startswith(PROMPT)


def test_streamed_echo_with_logprobs_matches_the_response(client):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                echo=True, extra_body={"ignore_eos": True})
    full = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(stream=True, **body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert text == full.text and tokens == full.logprobs.tokens


def _embed(client, inputs, **extra):
    r = client.embeddings.create(model=MODEL, input=inputs, extra_body=extra or None)
    return [d.embedding for d in r.data], r


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_embeddings_are_normalised_and_independent_of_the_batch(client, engine):
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by 4%.",
             "A kitten rested on the rug."]
    vecs, r = _embed(client, texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in texts)
    for v in vecs:
        assert len(v) == engine.model_config.hidden_size
        assert math.isclose(math.sqrt(_cos(v, v)), 1.0, abs_tol=1e-4)
    alone, _ = _embed(client, texts[0])
    assert _cos(alone[0], vecs[0]) > 0.9999  # batched or not, cached or not
    assert _cos(vecs[0], vecs[2]) > _cos(vecs[0], vecs[1])  # cats are nearer each other
    last, _ = _embed(client, texts[0], pooling="last")
    assert _cos(last[0], vecs[0]) < 0.999


def test_embeddings_base64_and_errors(client, server):
    import base64
    import struct

    floats, _ = _embed(client, "hello")
    r = client.embeddings.create(model=MODEL, input="hello", encoding_format="base64")
    raw = r.data[0].embedding
    if isinstance(raw, str):
        raw = list(struct.unpack(f"<{len(floats[0])}f", base64.b64decode(raw)))
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(raw, floats[0]))
    with server.client() as c:
        for body, param in [({"input": ""}, "input"), ({"input": "a", "dimensions": 7},
                                                       "dimensions"),
                            ({"input": "a", "pooling": "max"}, "pooling"),
                            ({"input": "a", "encoding_format": "int8"}, "encoding_format")]:
            resp = c.post("/v1/embeddings", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, body


@pytest.mark.slow  # builds engines of the default model
def test_chunked_prefill_gives_the_same_prompt_outputs(default_model_path):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.llm import LLM
    from servelm.protocol import EngineRequest, SamplingParams

    text = "In the beginning the universe was created. This has made a lot of people angry."
    out = {}
    for budget in (None, 8):
        kw = {"max_num_batched_tokens": budget} if budget else {}
        engine = build_engine(EngineArgs(model=MODEL, kv_cache_memory=32 * 2**20,
                                         dtype="float32", **kw))
        ids = engine.tokenizer.encode(text)
        for name, params in [("lp", SamplingParams(max_tokens=1, prompt_logprobs=0)),
                             ("mean", SamplingParams(max_tokens=1, pooling="mean"))]:
            engine.add_request(EngineRequest(name, ids, params))
            deltas = []
            while engine.has_unfinished:
                deltas += engine.step()
            out[budget, name] = deltas[0]
    lp_full = [x.logprob for x in out[None, "lp"].prompt_logprobs[1:]]
    lp_chunk = [x.logprob for x in out[8, "lp"].prompt_logprobs[1:]]
    assert len(lp_full) == len(ids) - 1
    assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(lp_full, lp_chunk))
    a, b = out[None, "mean"].embedding, out[8, "mean"].embedding
    assert all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(a, b))
    # the Python API returns them too
    got = LLM(engine=engine).generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                           pooling="mean"))[0].outputs[0]
    assert [x.logprob for x in got.prompt_logprobs[1:]] == pytest.approx(lp_chunk, abs=2e-3)
    assert got.embedding == pytest.approx(b, rel=1e-3, abs=1e-3)
