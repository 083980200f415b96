"""store_kv: write the new tokens' K and V into their slots of the paged cache.

    k_cache: [num_slots, K, D]    slot = block * block_size + offset
    slot_mapping[t] < 0           token t is padding (a CUDA-graph bucket): not written

Owns the scatter kernel and its torch reference. Never allocates cache memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAD_SLOT = -1  # slot_mapping value of a padding token


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, K, D] (last dim contiguous); caches: [num_slots, K, D]; slot_mapping: [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_K=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Torch reference: the same scatter, skipping padding slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v[keep].to(v_cache.dtype))
