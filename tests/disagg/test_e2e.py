"""Disaggregation end to end: the openai client through the disaggregation router to a
prefill and a decode worker (a tiny random-weight model, HTTP servers in this process), over
tcp and shm; greedy tokens equal to one colocated worker's."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from live_server import MODEL, LiveServer  # noqa: E402
from tiny_models import make_tiny_engine, make_tiny_hf_model  # noqa: E402

from servelm.disagg.http import info  # noqa: E402
from servelm.router.disagg import build_disagg_app  # noqa: E402
from tests.router.test_router import _Uvicorn, _port  # noqa: E402

PROMPTS = [[5 + (i * 37 + j * 11) % 370 for j in range(n)] for i, n in
           enumerate((41, 64, 97))]


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama", seed=3)


def _tokens(client, prompt, stream: bool, max_tokens: int = 8) -> list[str]:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0)
    if not stream:
        return client.completions.create(**kw).choices[0].logprobs.tokens
    out = []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                out.extend(c.logprobs.tokens)
    return out


def _worker(hf, role, transport, tmp_path):
    address = {"tcp": "tcp://127.0.0.1:0", "shm": f"shm://{tmp_path}/kv.sock"}[transport]
    engine = make_tiny_engine(hf, disagg_role=role, kv_transport=transport,
                              kv_address=address if role == "prefill" else "",
                              max_num_batched_tokens=32)
    server = LiveServer(engine)
    args = engine.engine_args
    server.state.disagg = {**info(args), "kv_address": getattr(engine.kv_connector, "address",
                                                                "")}
    return engine, server


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_router_prefill_decode_equals_colocated(hf, transport, tmp_path):
    colocated = LiveServer(make_tiny_engine(hf, max_num_batched_tokens=32))
    p_engine, prefill = _worker(hf, "prefill", transport, tmp_path)
    d_engine, decode = _worker(hf, "decode", transport, tmp_path)
    router = _Uvicorn(build_disagg_app([prefill.url], [decode.url], probe_interval=0.2),
                      _port())
    try:
        ref = openai.OpenAI(base_url=colocated.url + "/v1", api_key="x")
        dis = openai.OpenAI(base_url=router.url + "/v1", api_key="x")
        for i, prompt in enumerate(PROMPTS):
            want = _tokens(ref, prompt, stream=False)
            assert _tokens(dis, prompt, stream=bool(i % 2)) == want
        d, p = d_engine.kv_connector.stats, p_engine.kv_connector.stats
        assert d.num_completed == len(PROMPTS) and not d.fallbacks, d
        assert p.num_completed == len(PROMPTS)
        block = 4
        assert d.num_blocks == sum((len(x) - 1) // block for x in PROMPTS)
        # decode ran only each prompt's tail past its last transferred block
        assert d_engine.stats.num_computed_prompt_tokens == sum(
            len(x) - (len(x) - 1) // block * block for x in PROMPTS)
        m = decode.wait_idle()
        assert m["servelm_kv_transfers_completed_total"] == len(PROMPTS)
        assert m["servelm_kv_transfer_bytes_total"] == d.num_bytes > 0
        assert m["servelm_kv_transfers_in_flight"] == 0
        assert prefill.wait_idle()["servelm_kv_transfer_bytes_total"] == d.num_bytes
        for eng in (p_engine, d_engine):
            assert eng.block_manager.num_pinned_blocks == 0
    finally:
        router.stop()
        for s in (prefill, decode, colocated):
            s.stop()
        p_engine.kv_connector.close()
        d_engine.kv_connector.close()


def test_prefill_worker_down_decode_computes_the_prompt(hf, tmp_path):
    colocated = LiveServer(make_tiny_engine(hf, max_num_batched_tokens=32))
    p_engine, prefill = _worker(hf, "prefill", "tcp", tmp_path)
    d_engine, decode = _worker(hf, "decode", "tcp", tmp_path)
    router = _Uvicorn(build_disagg_app([prefill.url], [decode.url], probe_interval=0.2),
                      _port())
    try:
        prefill.stop()
        p_engine.kv_connector.close()  # the whole prefill worker is gone
        ref = openai.OpenAI(base_url=colocated.url + "/v1", api_key="x")
        dis = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        prompt = PROMPTS[1]
        assert _tokens(dis, prompt, stream=True) == _tokens(ref, prompt, stream=False)
        m = decode.wait_idle()
        assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
        assert d_engine.block_manager.num_pinned_blocks == 0
        assert d_engine.kv_connector.stats.num_started == 0  # sent without a transfer
        fallbacks = router.server.config.app.state.router.metrics.fallbacks
        assert fallbacks.labels("prefill_failed")._value.get() == 1
    finally:
        router.stop()
        for s in (decode, colocated):
            s.stop()
        d_engine.kv_connector.close()
