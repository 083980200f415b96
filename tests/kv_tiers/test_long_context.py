"""Long contexts on a tiny random-weight model with a long max_position_embeddings and rope
scaling (llama3, YaRN): admission, chunked prefill in budget slices (each chunk after the
first attends its context through the torch backend's mask-free split path), decodes over
every key in the C++ paged kernel and in the torch path, the prefix cache, preemption with
the sequence's blocks coming back from the host tier, and memory per token equal to the
planner's. Greedy output is the same in every arrangement.

The 16k-token cases run by default; the same at 128k tokens is marked slow."""

import functools
import random

import pytest
from tiny_models import make_tiny_engine, make_tiny_hf_model

from servelm.planner.kv import plan_kv
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams

_ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192},
}
_MAX_POS = 131072 + 256


@functools.cache  # one build per variant for the module (transformers' init is slow)
def _model(rope: str, heads: int = 2):
    return make_tiny_hf_model("llama", seed=7, vocab_size=128, hidden_size=16,
                              intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=heads, num_key_value_heads=1, head_dim=8,
                              max_position_embeddings=_MAX_POS, rope_scaling=_ROPE[rope])


def _engine(hf, num_tokens, budget=4096, **kw):
    kw.setdefault("num_blocks", num_tokens // 16 + 64)
    return make_tiny_engine(hf, block_size=16, max_num_batched_tokens=budget, **kw)


def _run(engine, reqs):
    """reqs: (request_id, prompt, max_tokens); all at once, invariants after every step."""
    out, fin = {r: [] for r, _, _ in reqs}, {}
    for rid, prompt, n in reqs:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
            if d.timings is not None:
                fin[d.request_id] = d.timings
        engine.check_invariants()
    return out, fin


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def _backend(engine):
    return engine.runner.backend


def _check_memory_per_token(engine, hf, num_tokens):
    """The pool's bytes per token are the planner's for this model (fp32 KV)."""
    plan = plan_kv(engine.model_config, "fp32", context=num_tokens)
    kv = engine.runner.kv_cache
    assert kv.block_nbytes / kv.block_size == plan.kv_bytes_per_token
    assert plan.kv_bytes_per_request == num_tokens * plan.kv_bytes_per_token


def _long_context_case(rope, n, budget, cases, heads=2):
    hf = _model(rope, heads)
    prompt = _prompt(n)
    chunked = _engine(hf, n, budget)
    assert chunked.model_config.rope_scaling["rope_type"] == rope
    assert chunked.max_model_len >= n + 8
    _check_memory_per_token(chunked, hf, n)
    want, fin = _run(chunked, [("long", prompt, 6)])
    assert _backend(chunked).split_prefill_calls >= n // budget - 1  # every later chunk
    assert fin["long"].prefill_time > 0
    # The prefix cache: the same context again is all hits but the last token.
    again, fin = _run(chunked, [("again", prompt, 6)])
    assert again["again"] == want["long"]
    assert fin["again"].num_cached_tokens == (n - 1) // 16 * 16
    if "torch_decode" in cases:  # decodes on the torch path instead of the C++ kernel
        torch_path = _engine(hf, n, budget, cpu_kernels="torch")
        assert _backend(torch_path).decode_kernel is None
        got, _ = _run(torch_path, [("long", prompt, 6)])
        assert got["long"] == want["long"]
    if "unchunked" in cases:  # one prefill of the whole prompt
        whole = _engine(hf, n, n + 64, enable_chunked_prefill=False)
        got, _ = _run(whole, [("long", prompt, 6)])
        assert got["long"] == want["long"]
        assert _backend(whole).split_prefill_calls == 0
    return hf, prompt, want["long"]


def _preempt_and_reload(hf, prompt, want, n):
    """The long sequence is preempted (a short one started first needs its blocks), its
    blocks evicted from the pool into host memory, and reloaded when it resumes."""
    pool = n // 16 + 2  # the long one and the short one cannot both hold all their blocks
    engine = _engine(hf, n, 4096, num_blocks=pool, kv_host_memory_gb=(n + 4096) * 64 / 1e9,
                     kv_reload_policy="always")
    short = _prompt(32, seed=1)
    out, fin = _run(engine, [("short", short, 300), ("long", prompt, 6)])
    assert fin["long"].num_preemptions >= 1
    assert out["long"] == want
    host = engine.kv_connector.by_name["host"].stats
    assert host.num_stored > 0 and host.num_hits > 0, engine.kv_connector.stats()
    engine.kv_connector.close()


def test_admission_refuses_past_the_context_by_name():
    hf = _model("llama3")
    engine = _engine(hf, _MAX_POS - 256, num_blocks=_MAX_POS // 16)
    with pytest.raises(InvalidParameterError) as e:
        engine.add_request(EngineRequest("x", [5] * engine.max_model_len, SamplingParams(
            max_tokens=1)))
    assert e.value.param == "prompt"


def test_16k_context_chunked_unchunked_prefix_cache_both_decode_paths():
    _long_context_case("yarn", 16384, 4096, {"torch_decode", "unchunked"})


def test_16k_context_preempted_and_reloaded_from_host():
    hf, prompt, want = _long_context_case("llama3", 16384, 4096, set())
    _preempt_and_reload(hf, prompt, want, 16384)


@pytest.mark.slow
def test_128k_context_end_to_end():
    n = 131072 - 8
    hf, prompt, want = _long_context_case("llama3", n, 8192, set(), heads=1)
    _preempt_and_reload(hf, prompt, want, n)


@pytest.mark.parametrize("scaled", [False, True])
def test_split_prefill_equals_the_masked_prefill(scaled):
    """The mask-free path for a chunk after context (two flash calls merged by log-sum-exp)
    against the masked one, with GQA (4 query heads on 2 KV heads) and fp8-style scales."""
    import torch

    from servelm.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    backend = TorchAttentionBackend.__new__(TorchAttentionBackend)
    backend.scale, backend.split_prefill_calls = 8 ** -0.5, 0
    c, q_len, h, kh, d = 300, 37, 4, 2, 8
    q = torch.randn(q_len, h, d)
    k, v = torch.randn(c + q_len, kh, d), torch.randn(c + q_len, kh, d)
    scales = (torch.rand(kh) + 0.5, torch.rand(kh) + 0.5) if scaled else (None, None)
    pos, q_pos = torch.arange(c + q_len), torch.arange(c, c + q_len)
    want = backend._prefill(q, k, v, pos[None, :] <= q_pos[:, None], *scales)
    got = backend._prefill_after(q, k[:c], v[:c], k[c:], v[c:], *scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backend.split_prefill_calls == 1
