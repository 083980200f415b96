"""A MoE model's expert load on /metrics: tokens per expert per layer and the busiest
expert's share, equal to the model's own counters (a dense model exports none)."""

import re

import pytest

from live_server import MODEL, LiveServer
from servelm.core.contract import EXPERT_TOKENS_EVERY
from tiny_families import make_tiny_family_model
from tiny_models import make_tiny_engine


def _series(text, name):
    out = {}
    for line in text.splitlines():
        m = re.match(rf'{name}\{{(.*)\}} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
            out[tuple(labels[k] for k in sorted(labels))] = float(m[2])
    return out


def _experts(engine):
    from servelm.layers.moe import Experts

    return [m for m in engine.runner.model.modules() if isinstance(m, Experts)]


def test_expert_tokens_and_imbalance_match_the_model():
    engine = make_tiny_engine(make_tiny_family_model("qwen3_moe", seed=1))
    server = LiveServer(engine)
    try:
        with server.client() as c:
            steps = EXPERT_TOKENS_EVERY * 2 + 1
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7, 8, 9],
                                               "max_tokens": steps, "ignore_eos": True,
                                               "temperature": 0})
            assert r.status_code == 200, r.text
            text = c.get("/metrics").text
    finally:
        server.stop()
    tokens = _series(text, "servelm_moe_expert_tokens_total")
    imbalance = _series(text, "servelm_moe_expert_load_imbalance")
    experts = _experts(engine)
    assert len(experts) == 2 and tokens  # both layers are MoE in the tiny model
    # the last snapshot (a multiple of EXPERT_TOKENS_EVERY steps) is at most the model's
    # counters now, and every routed token of it is counted
    for layer, m in enumerate(experts):
        now = m.num_routed_tokens.tolist()
        got = [tokens.get((str(e), str(layer)), 0.0) for e in range(len(now))]
        assert all(g <= n for g, n in zip(got, now))
        k = engine.runner.model.config.num_experts_per_tok
        assert sum(got) % k == 0 and sum(got) >= k * (5 + EXPERT_TOKENS_EVERY)
        assert imbalance[(str(layer),)] == pytest.approx(max(got) * len(got) / sum(got))


def test_a_dense_model_exports_no_expert_series(tiny_hf):
    engine = make_tiny_engine(tiny_hf("llama"))
    server = LiveServer(engine)
    try:
        with server.client() as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7],
                                               "max_tokens": EXPERT_TOKENS_EVERY + 2,
                                               "ignore_eos": True})
            text = c.get("/metrics").text
    finally:
        server.stop()
    assert r.json()["usage"]["completion_tokens"] == EXPERT_TOKENS_EVERY + 2
    assert not _series(text, "servelm_moe_expert_tokens_total")
