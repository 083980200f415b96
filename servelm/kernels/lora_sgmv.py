"""SGMV: segmented gather matrix-vector products for batched LoRA (Punica / S-LoRA style).

One launch computes, for every segment g of the flat batch (the rows of one adapter slot),

    out[t, :] += x[t, :] @ w[slot_g].T        for t in token_idx[seg_start[g]:seg_start[g+1]]

    x:   [T, K]         rows read through token_idx (the batch is not reordered)
    w:   [S, N, K]      one matrix per slot: LoRA A ([S, slices * R, hidden], the shrink) or
                        one slice's B ([S, size, R], the expand)
    out: [T, N]         any row and column strides (a column slice of a fused projection's
                        output); accumulated in fp32, stored in out's dtype

Grid (segments, ceil(longest segment / BLOCK_M), ceil(N / BLOCK_N)); a program past its
segment's end returns at once. Fixed, untuned blocks. servelm/lora/segmented.py calls it
on CUDA (one shrink, then one expand per slice).

Owns the kernel, its launcher and its torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, tok_ptr, seg_start_ptr, seg_slot_ptr, N, K,
                 stride_xm, stride_xk, stride_ws, stride_wn, stride_wk, stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(seg_start_ptr + g)
    end = tl.load(seg_start_ptr + g + 1)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:
        slot = tl.load(seg_slot_ptr + g).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            wv = tl.load(w_ptr + slot * stride_ws + cols[None, :] * stride_wn
                         + ks[:, None] * stride_wk,
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
            acc += tl.dot(xv.to(DOT_DTYPE), wv.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + tok[:, None] * stride_om + cols[None, :] * stride_on
        ok = row_ok[:, None] & col_ok[None, :]
        prev = tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=ok)


def sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, token_idx: torch.Tensor,
         seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
         block_m: int = 16, block_n: int = 32, block_k: int = 32) -> None:
    """In place: out[t] += x[t] @ w[slot].T for every row t of every segment (module doc)."""
    if x.dim() != 2 or w.dim() != 3 or out.dim() != 2:
        raise ValueError(f"sgmv wants x [T, K], w [S, N, K], out [T, N]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")
    if w.shape[2] != x.shape[1] or w.shape[1] != out.shape[1] or out.shape[0] != x.shape[0]:
        raise ValueError(f"sgmv shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"out {tuple(out.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"sgmv: x is {x.dtype}, w is {w.dtype}")
    num_segments = seg_slot.numel()
    if num_segments == 0 or max_seg_len == 0:
        return
    dot, precision = dot_dtype(x.dtype)
    n, k = w.shape[1], w.shape[2]
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, out, token_idx, seg_start, seg_slot, n, k,
                       x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                       out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, DOT_DTYPE=dot, DOT_PRECISION=precision)


def sgmv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, token_idx: torch.Tensor,
             seg_start: torch.Tensor, seg_slot: torch.Tensor) -> None:
    """The torch reference of `sgmv`, one segment at a time (fp32 accumulation)."""
    starts = seg_start.tolist()
    for g, slot in enumerate(seg_slot.tolist()):
        rows = token_idx[starts[g]:starts[g + 1]].long()
        if rows.numel():
            prod = x[rows].float() @ w[slot].float().t()
            out[rows] = (out[rows].float() + prod).to(out.dtype)


__all__ = ["sgmv", "sgmv_ref"]
