"""store_kv writes each token's K/V into its slot and skips padding slots (-1)."""

import pytest
import torch

from servelm.kernels.store_kv import PAD_SLOT, store_kv, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_kv_heads, head_dim, src_dtype, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_tokens = 64, 11
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    # k, v as the model hands them over: views into a fused qkv row (not contiguous)
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[[2, 7]] = PAD_SLOT
    qkv, k_cache, v_cache, slots = (x.to(DEVICE) for x in (qkv, k_cache, v_cache, slots))
    return qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 24), (8, 32)])
def test_store_kv_matches_reference(dtype, num_kv_heads, head_dim):
    k, v, k_cache, v_cache, slots = _case(num_kv_heads, head_dim, dtype, dtype,
                                          num_kv_heads * 100 + head_dim)
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ours_k, ours_v, slots)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(ours_k, k_cache) and torch.equal(ours_v, v_cache)
    real = slots >= 0
    assert torch.equal(ours_k[slots[real]], k[real])


def test_store_kv_casts_to_the_cache_dtype():
    # fp32 -> fp16 (the interpreter rounds fp32 -> bf16 toward zero, a GPU to nearest even,
    # so the exact check uses fp16).
    k, v, k_cache, v_cache, slots = _case(2, 16, torch.float32, torch.float16, 1)
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ours_k, ours_v, slots)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(ours_k, k_cache) and torch.equal(ours_v, v_cache)
