"""store_kv: write the new tokens' K and V into their slots of the paged cache.

    k_cache: [num_slots, K, D]    slot = block * block_size + offset
    slot_mapping[t] < 0           token t is padding (a CUDA-graph bucket): not written

An fp8 cache (float8_e4m3fn) stores codes: k / k_scale[head], saturated to +-448 and rounded
to nearest even (servelm.kernels.fp8_format is the definition; the kernel rounds in float32 first,
see servelm/kernels/fp8.py, so it matches torch's cast bit for bit).

Owns the scatter kernel and its torch reference. Never allocates cache memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.fp8 import saturate_round_e4m3
from servelm.kernels.fp8_format import FP8_DTYPE, dequantize_fp8, quantize_fp8

PAD_SLOT = -1  # slot_mapping value of a padding token


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr):
    # One program per token: copies its [K, D] key and value tiles into the cache slot.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:  # codes = saturate(x / scale[head]) on the e4m3 grid
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
        k = saturate_round_e4m3(k.to(tl.float32) / k_scale[:, None])
        v = saturate_round_e4m3(v.to(tl.float32) / v_scale[:, None])
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, K, D] (last dim contiguous); caches: [num_slots, K, D]; slot_mapping: [T];
    k_scale, v_scale: [K] float32, required for (and only for) an fp8 cache."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    is_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_K=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=is_fp8)


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """True for an fp8 cache, which needs both scales; a float cache takes none."""
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if is_fp8 != (k_scale is not None) or is_fp8 != (v_scale is not None):
        raise ValueError(f"k_scale/v_scale go with an fp8 cache and only with one; cache is "
                         f"{k_cache.dtype}, scales given: {k_scale is not None}, "
                         f"{v_scale is not None}")
    return is_fp8


def dequantize_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' view of a cache: an fp8 one as float32 codes * scale[head]; a float
    one as it is."""
    if not check_kv_scales(k_cache, k_scale, v_scale):
        return k_cache, v_cache
    return (dequantize_fp8(k_cache, k_scale[:, None]), dequantize_fp8(v_cache, v_scale[:, None]))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Torch reference: the same scatter, skipping padding slots (fp8: quantize_fp8)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if check_kv_scales(k_cache, k_scale, v_scale):
        # index_copy_ has no fp8 CPU kernel: scatter the bytes.
        k_cache.view(torch.uint8).index_copy_(
            0, slots, quantize_fp8(k[keep], k_scale[:, None]).view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(
            0, slots, quantize_fp8(v[keep], v_scale[:, None]).view(torch.uint8))
        return
    k_cache.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v[keep].to(v_cache.dtype))
