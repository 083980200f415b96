"""The triton backend computes what the torch reference backend computes.

Backend level: one mixed step (decodes, a fresh prompt, a chunk after a prefix ending
mid-block) through both backends on copies of the same cache. Engine level: a tiny random
model gives the same greedy tokens with either backend, through chunked prefill, prefix-cache
hits and batched decode.
"""

import subprocess
import sys

import pytest
import torch

from servelm.attention import get_backend_class
from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.config import ModelConfig
from servelm.llm import LLM
from servelm.protocol import SamplingParams
from span_batches import batch_from_spans  # tests/span_batches.py (tests/ is on sys.path)

# Triton runs compiled on a GPU, interpreted on the CPU (conftest).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_triton_is_imported_only_when_chosen():
    code = ("import sys, servelm.attention, servelm.engine_builder, servelm.llm; "
            "assert 'triton' not in sys.modules; "
            "servelm.attention.get_backend_class('triton'); assert 'triton' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _mixed_batch(block_size: int) -> ForwardBatch:
    """2 decodes (contexts 6 and 9), a fresh 5-token prompt, 4 new tokens after a 7-token
    prefix (mid-block for block_size 4). Blocks are handed out in a scrambled order."""
    spans = [(5, 1), (8, 1), (0, 5), (7, 4)]  # (context, new tokens)
    free = [11, 3, 7, 0, 14, 2, 9, 5, 12, 1, 8, 6, 13]
    return batch_from_spans(spans, block_size, free, num_decodes=2)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_backend_matches_torch_backend_on_a_mixed_step(num_heads, num_kv_heads):
    config = ModelConfig("llama", 32, 64, 64, 1, num_heads, num_kv_heads, 16, 64)
    gen = torch.Generator().manual_seed(num_heads + num_kv_heads)
    caches = {}
    for name in ("torch", "triton"):
        caches[name] = KVCache(config, 16, 4, torch.float32, DEVICE)
    caches["triton"].k.copy_(torch.randn(caches["torch"].k.shape, generator=gen))
    caches["triton"].v.copy_(torch.randn(caches["torch"].v.shape, generator=gen))
    caches["torch"].k.copy_(caches["triton"].k)
    caches["torch"].v.copy_(caches["triton"].v)
    batch = _mixed_batch(4)
    q = torch.randn(batch.num_tokens, num_heads, 16, generator=gen).to(DEVICE)
    k = torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen).to(DEVICE)
    v = torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen).to(DEVICE)
    outs = {}
    for name, cache in caches.items():
        backend = get_backend_class(name)(cache, num_heads, 0.25)
        batch.attn_metadata = backend.build_metadata(batch)
        outs[name] = backend.forward(0, q, k, v, batch)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(caches["triton"].k, caches["torch"].k, atol=0, rtol=0)


def _greedy(engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("qwen3", 1)])
def test_tiny_model_greedy_tokens_match_torch_backend(arch, kv_heads, tiny_hf, tiny_engine):
    hf = tiny_hf(arch, num_key_value_heads=kv_heads)
    shared = [7, 200, 31, 5, 99, 42, 18]  # 7 tokens: a cached prefix ending mid-block
    prompts = [shared + [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], shared + [11, 12],
               [250, 1], shared]
    results = {}
    for backend in ("torch", "triton"):
        # a small token budget: prompts are prefilled in chunks that follow cached context
        engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=8,
                             device=DEVICE.type)
        _greedy(engine, [shared + [1]], 1)  # warm the prefix cache
        results[backend] = _greedy(engine, prompts, 12)
    for ours, ref in zip(results["triton"], results["torch"]):
        assert ours.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in ours.logprobs]),
                                   torch.tensor([lp.logprob for lp in ref.logprobs]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_fp8_cache_backend_matches_torch_backend_on_a_mixed_step(num_heads, num_kv_heads):
    """fp8 cache, a scale per KV head: both backends store the same codes (bit for bit) and
    compute the same attention over them (scales folded into scores and output in both)."""
    config = ModelConfig("llama", 32, 64, 64, 1, num_heads, num_kv_heads, 16, 64)
    gen = torch.Generator().manual_seed(num_heads * 7 + num_kv_heads)
    caches = {name: KVCache(config, 16, 4, torch.float8_e4m3fn, DEVICE)
              for name in ("torch", "triton")}
    k_scale = torch.rand(1, num_kv_heads, generator=gen) + 0.5
    v_scale = torch.rand(1, num_kv_heads, generator=gen) + 0.5
    initial = torch.randn(caches["torch"].k.shape, generator=gen) * 2
    for cache in caches.values():
        cache.set_scales(k_scale, v_scale)
        cache.k.copy_(initial.to(torch.float8_e4m3fn))
        cache.v.copy_((-initial).to(torch.float8_e4m3fn))
    batch = _mixed_batch(4)
    q = torch.randn(batch.num_tokens, num_heads, 16, generator=gen).to(DEVICE)
    k = (torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen) * 3).to(DEVICE)
    v = torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen).to(DEVICE)
    outs = {}
    for name, cache in caches.items():
        backend = get_backend_class(name)(cache, num_heads, 0.25)
        batch.attn_metadata = backend.build_metadata(batch)
        outs[name] = backend.forward(0, q, k, v, batch)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-5, rtol=1e-5)
    for a, b in ((caches["triton"].k, caches["torch"].k), (caches["triton"].v, caches["torch"].v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # and the codes are the quantized new K: dequantized, within e4m3's 2^-4 of k
    stored = caches["torch"].k[0][batch.slot_mapping].float() * k_scale[0, :, None].to(DEVICE)
    assert ((stored - k).abs() <= k.abs() * 2**-4 + 2**-9 * k_scale.max()).all()
