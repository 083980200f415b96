"""Prefill/extend attention: a flat batch of query tokens over paged K/V, causal, GQA.

Each sequence's new tokens attend to its cached prefix and, causally, to each other. The new
tokens' K/V are written to the cache first (store_kv), so every key is read through the block
table; a prefix that ends mid-block needs no special case:

    sequence b:  keys   [0 ................ ctx | ctx ........ seq_len)
                         cached prefix          new tokens (= queries)
    query i (0 <= i < q_len) sits at position ctx + i and sees keys 0 .. ctx + i

    block_tables[b] = [7, 2, 9], block_size 4:  position p -> slot table[p // 4] * 4 + p % 4

Grid (query tiles of BLOCK_M, H, B). Decodes (one query) work too, but the decode kernel reads
each K/V block once per group of heads and splits long contexts, so the backend sends them there.

An fp8 cache is read as codes: a program serves one query head, hence one KV head, whose K
scale multiplies the scores and V scale the output (scalars; no dequantized tile).

Owns the kernel and its torch reference. Never writes the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype
from servelm.kernels.store_kv import check_kv_scales, dequantize_kv

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    kv_head = head // GROUP
    if KV_FP8:  # fp8 codes: fold this head's scales into the scores and the output
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    else:
        qk_scale = scale_log2
        v_scale = 1.0
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BM, BD]
    q_pos = ctx + rows
    kv_end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)  # the last row's causal horizon
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n in range(0, kv_end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        block = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # key 0 is seen by every row
        s = tl.where(seen, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, max_query_len: int, block_size: int, scale: float,
                      out: torch.Tensor | None = None, block_m: int = 64,
                      block_n: int = 64, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (B sequences back to back); caches: [num_slots, K, D] already holding the
    new tokens; block_tables: [B, max_blocks]; query_start_loc: [B + 1] (into q);
    seq_lens: [B] (prefix + new tokens) -> out: [T, H, D].
    k_scale, v_scale: [K] float32 for an fp8 cache (float caches take none)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    dot_t, precision = dot_dtype(q.dtype)
    is_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale * LOG2E,
        k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_DTYPE=dot_t, DOT_PRECISION=precision, KV_FP8=is_fp8)
    return out


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_size: int, scale: float,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference, one sequence at a time in float32 with an explicit causal mask.
    An fp8 cache is dequantized first (codes * scale[head])."""
    k_cache, v_cache = dequantize_kv(k_cache, v_cache, k_scale, v_scale)
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        s, e, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [C, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (e - s), n, device=q.device)
        scores = torch.einsum("qhd,chd->hqc", q[s:e].float(), k) * scale
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[s:e] = torch.einsum("hqc,chd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
