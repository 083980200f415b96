"""KV tiers through the HTTP server on a tiny model: a returning prompt whose blocks were
evicted into host memory is reloaded, its x-servelm-timing header carries the cache explain,
and /metrics counts the host tier's hits."""

import json
import random
import re

from live_server import MODEL, LiveServer
from tiny_models import make_tiny_engine


def _complete(c, prompt):
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                       "ignore_eos": True, "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r


def test_returning_prompt_reloaded_with_its_cache_explain_in_the_header(tiny_hf):
    engine = make_tiny_engine(tiny_hf("llama", seed=2), num_blocks=40, block_size=4,
                              kv_host_memory_gb=1e-3, kv_reload_policy="always")
    rng = random.Random(0)
    history = [rng.randrange(5, 380) for _ in range(100)]
    server = LiveServer(engine)
    try:
        with server.client() as c:
            first = _complete(c, history)
            for _ in range(2):  # other prompts push the history out of the device pool
                _complete(c, [rng.randrange(5, 380) for _ in range(100)])
            again = _complete(c, history)
            text = c.get("/metrics").text
    finally:
        server.stop()
    ex = json.loads(again.headers["x-servelm-timing"])["cache_explain"]
    assert ex["decision"] == "reload" and ex["host_tokens"] == ex["loaded_tokens"] == 96, ex
    assert "cache_explain" in json.loads(first.headers["x-servelm-timing"])
    tokens = [r.json()["choices"][0]["logprobs"]["tokens"] for r in (first, again)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 4  # the same greedy continuation
    hits = re.search(r'servelm_kv_tier_hit_blocks_total\{tier="host"\} (\S+)', text)
    assert hits and float(hits[1]) == 24
    assert 'servelm_kv_tier_decisions_total{decision="reload"} 1.0' in text
