"""store_kv writes each token's K/V into its slot and skips padding slots (-1)."""

import pytest
import torch

from servelm.kernels.store_kv import PAD_SLOT, store_kv, store_kv_ref
from servelm.kernels.fp8_format import FP8_DTYPE, FP8_MAX

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


def _codes(x):
    return x.view(torch.uint8)  # fp8 tensors compared byte for byte


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 24), (8, 32)])
def test_store_kv_fp8_matches_reference_bit_for_bit(src_dtype, num_kv_heads, head_dim):
    """fp8 cache: codes = saturate(x / scale[head]) rounded to nearest even, as torch casts.
    Values span subnormals to past the e4m3 range (saturation), with a scale per head."""
    k, v, _, _, slots = _case(num_kv_heads, head_dim, src_dtype, torch.float32,
                              num_kv_heads * 10 + head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    spread = torch.logspace(-3, 3, head_dim).to(src_dtype).to(DEVICE)  # 0.001 .. 1000
    k, v = k * spread, v * spread
    k_scale = (torch.rand(num_kv_heads, generator=gen) + 0.5).to(DEVICE)
    v_scale = (torch.rand(num_kv_heads, generator=gen) + 0.5).to(DEVICE)
    caches = [torch.zeros(64, num_kv_heads, head_dim, device=DEVICE).to(FP8_DTYPE)
              for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    store_kv_ref(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(_codes(caches[0]), _codes(caches[2]))
    assert torch.equal(_codes(caches[1]), _codes(caches[3]))
    real = slots >= 0
    written = torch.zeros(64, dtype=torch.bool, device=DEVICE)
    written[slots[real]] = True
    assert (caches[0][~written].float() == 0).all()  # padding tokens write nothing
    stored = caches[0][slots[real]].float() * k_scale[:, None]
    want = k[real].float()
    x = want.abs() / k_scale[:, None]
    assert torch.isfinite(stored).all()
    assert torch.equal(stored[x > FP8_MAX].abs(), (FP8_MAX * k_scale[:, None]).expand_as(
        x)[x > FP8_MAX])  # saturated to +-448 * scale, not NaN
    normal = (x >= 2**-6) & (x <= FP8_MAX)  # e4m3 keeps 3 mantissa bits: error <= 2^-4
    assert normal.sum() > want.numel() // 2 and (x > FP8_MAX).any()
    assert ((stored - want).abs() / want.abs())[normal].max() <= 2**-4 + 1e-6


def test_store_kv_fp8_needs_scales():
    k, v, _, _, slots = _case(2, 16, torch.float32, torch.float32, 3)
    cache = torch.zeros(64, 2, 16, device=DEVICE).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, v, cache, cache.clone(), slots)
