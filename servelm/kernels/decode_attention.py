"""Decode attention over the paged KV cache with a split-K (flash-decoding) reduction.

One query token per sequence. A long context leaves few programs per sequence if each reads
the whole context, so the context is cut into `num_splits` pieces read in parallel:

    stage 1  grid (B, K, S): the G = H/K query heads sharing KV head k read split s of the
             context once, and write a partial output and its log-sum-exp
                 partial_out: [B, H, S, D] fp32   partial_lse: [B, H, S] fp32 (log2 units)
    stage 2  grid (B, H): out = sum_s exp2(lse_s - lse) * partial_out_s

Every split has the same length, ceil(seq_len / S) rounded up to the key tile, so a split past
the end of a short sequence is empty (lse = -inf) and weighs nothing in stage 2. That keeps S
fixed for a CUDA graph while sequence lengths change. A sequence of length 0 (a graph's padding
row) gets an all-zero output.

An fp8 cache (codes times a scale per KV head) is read as it is: a program serves one KV
head, so K's scale multiplies the scores and V's the partial output, both scalars, and no
dequantized tile is formed.

Batch-invariant splits (`split_len` > 0, for a deterministic mode): every split is
`split_len` keys, fixed in key positions, and the caller launches enough of them for the
longest sequence (`fixed_num_splits`). A sequence's splits, and so its partial sums, are then
the same whatever else is in the batch; the extra splits of a short sequence are empty and
stage 2 adds them in split order (a sequential loop, not a tree whose shape would follow the
number of splits), each adding exactly zero. The default (0) sizes splits from `num_splits`,
which the heuristic picks from the batch: faster, but a row's bits follow its batch.

Owns the two kernels, the split heuristic and the torch reference. Never writes the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype
from servelm.kernels.store_kv import check_kv_scales, dequantize_kv

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256


def fixed_num_splits(max_seq_len: int, split_len: int) -> int:
    """Splits of `split_len` keys covering the longest sequence (batch-invariant mode)."""
    return max(1, triton.cdiv(max_seq_len, split_len))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int = 132) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU about twice over, without
    splits shorter than MIN_TOKENS_PER_SPLIT keys (whose reduce would cost more than it saves)."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    useful = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, useful, MAX_SPLITS))


@triton.jit
def _decode_partial_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        partial_out_ptr, partial_lse_ptr, scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qb, stride_qh, stride_cs, stride_ch, stride_bt,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr, SPLIT_LEN: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if KV_FP8:  # fp8 codes: fold the head's scales into the scores and the output
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    else:
        qk_scale = scale_log2
        v_scale = 1.0
    rows = tl.arange(0, BLOCK_H)  # the G query heads of this KV head, padded to BLOCK_H
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    seq_len = tl.load(seq_lens_ptr + b)
    if SPLIT_LEN > 0:  # batch-invariant: fixed key positions
        split_len = SPLIT_LEN
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    lse_ptrs = partial_lse_ptr + b * stride_lb + heads * stride_lh + split
    out_ptrs = (partial_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                + dims[None, :])
    if start >= end:  # past the end of this sequence: an empty split
        tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
        tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32),
                 mask=row_ok[:, None] & dim_ok[None, :])
        return
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BH, BD]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=row_ok)
    tl.store(out_ptrs, acc * (v_scale / l_i)[:, None], mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
        partial_out_ptr, partial_lse_ptr, out_ptr,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SEQUENTIAL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    dim_ok = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + b * stride_lb + h * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))  # [BLOCK_S]
    part = tl.load(partial_out_ptr + b * stride_pb + h * stride_ph
                   + splits[:, None] * stride_ps + dims[None, :],
                   mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0
    if SEQUENTIAL:  # split 0, then 1, ...: the same sums for any number of empty splits
        denom = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(NUM_SPLITS):
            w_s = tl.exp2(tl.load(partial_lse_ptr + b * stride_lb + h * stride_lh + s) - m)
            p_s = tl.load(partial_out_ptr + b * stride_pb + h * stride_ph + s * stride_ps + dims,
                          mask=dim_ok, other=0.0)
            denom += w_s
            acc += w_s * p_s
        out = acc / tl.where(denom > 0, denom, 1.0)
    else:
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     scale: float, num_splits: int, out: torch.Tensor | None = None,
                     block_n: int = 64, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, split_len: int = 0) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_slots, K, D]; block_tables: [B, max_blocks];
    seq_lens: [B] (keys to read, the new token's included) -> out: [B, H, D].
    k_scale, v_scale: [K] float32 for an fp8 cache (float caches take none).
    split_len > 0: batch-invariant splits of that many keys (a multiple of block_n);
    num_splits must then cover the longest sequence (fixed_num_splits)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    group = num_heads // num_kv_heads
    if split_len:
        if split_len % block_n:
            raise ValueError(f"split_len {split_len} must be a multiple of block_n {block_n}")
        if int(seq_lens.max()) > num_splits * split_len:
            raise ValueError(f"{num_splits} splits of {split_len} keys do not cover a "
                             f"sequence of {int(seq_lens.max())}")
    partial_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                              device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    dot_t, precision = dot_dtype(q.dtype)
    is_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse, scale * LOG2E,
        k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_DTYPE=dot_t, DOT_PRECISION=precision, KV_FP8=is_fp8, SPLIT_LEN=split_len)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        SEQUENTIAL=split_len > 0)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference, one sequence at a time in float32; a length-0 sequence gives zeros.
    An fp8 cache is dequantized first (codes * scale[head])."""
    k_cache, v_cache = dequantize_kv(k_cache, v_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros((num_seqs, num_heads, head_dim), dtype=torch.float32, device=q.device)
    for b in range(num_seqs):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [C, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,chd->hc", q[b].float(), k) * scale
        out[b] = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
    return out.to(q.dtype)
