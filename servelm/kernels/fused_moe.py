"""Fused MoE on the GPU: the routed experts of a step as two grouped GEMMs.

The T*k token-to-expert assignments are sorted by expert (a stable argsort, as the CPU path in
servelm/layers/moe.py does), so each expert's rows form one contiguous segment. One launch of
`grouped_gemm` computes, for every segment g of expert e_g,

    out[a, :] = x[src[a], :] @ w[e_g].T          for a in seg_start[g] .. seg_start[g+1]-1

    x:   [T, K]      rows read through src (the tokens are not copied or reordered)
    w:   [E, N, K]   one matrix per expert (w13 [E, 2I, H] or w2 [E, H, I])
    out: [A, N]      one row per assignment, in sorted order; fp32 accumulation

Grid (segments, ceil(longest segment / BLOCK_M), ceil(N / BLOCK_N)); a program past its
segment's end returns at once. `fused_moe` runs gate|up, the gated activation (torch), down
scaled by the routing weights, and puts the k rows of each token back in place and sums them
with a reshape (no atomics: the result does not depend on the order programs run in).

Owns the kernel, `fused_moe` (what Experts.forward calls on CUDA) and the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, src_ptr, seg_start_ptr, seg_expert_ptr, N, K,
                         stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
                         stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(seg_start_ptr + g)
    end = tl.load(seg_start_ptr + g + 1)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:
        expert = tl.load(seg_expert_ptr + g).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            wv = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn
                         + ks[:, None] * stride_wk,
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
            acc += tl.dot(xv.to(DOT_DTYPE), wv.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


class Segments:
    """The assignments of a step sorted by expert: order (sorted position -> flat
    assignment t*k + j), src (-> token), and the non-empty segments' starts and experts."""

    def __init__(self, ids: torch.Tensor, num_experts: int):
        t, k = ids.shape
        flat = ids.reshape(-1)
        self.order = flat.argsort(stable=True)
        self.src = (self.order // k).to(torch.int32)
        counts = torch.bincount(flat, minlength=num_experts)
        self.counts = counts
        nonzero = counts.nonzero().flatten()
        self.seg_expert = nonzero.to(torch.int32)
        ends = counts.cumsum(0)[nonzero]
        self.seg_start = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        self.max_len = int(counts.max()) if counts.numel() else 0


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, seg: Segments, src: torch.Tensor | None = None,
                 block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """[A, N]: row a = x[src[a]] @ w[expert of a's segment].T (src None: x's own row a)."""
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm wants x [T, K], w [E, N, K]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: x is {x.dtype}, w is {w.dtype}")
    rows = seg.src.numel()
    if src is None:
        src = torch.arange(rows, dtype=torch.int32, device=x.device)
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    dot, precision = dot_dtype(x.dtype)
    grid = (seg.seg_expert.numel(), triton.cdiv(seg.max_len, block_m), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](x, w, out, src, seg.seg_start, seg.seg_expert, n, k,
                               x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                               out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, DOT_DTYPE=dot, DOT_PRECISION=precision)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, act_and_mul, seg: Segments | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights, ids [T, k] ->
    sum_j weights[:, j] * expert_{ids[:, j]}(x)  [T, H]."""
    t, k = ids.shape
    seg = seg if seg is not None else Segments(ids, w13.shape[0])
    h = act_and_mul(grouped_gemm(x, w13, seg, seg.src))  # [A, I], sorted order
    y = grouped_gemm(h.contiguous(), w2, seg)  # [A, H]
    y = y * weights.reshape(-1)[seg.order].unsqueeze(1).to(y.dtype)
    back = torch.empty_like(y)
    back[seg.order] = y  # assignment t*k + j back at its place
    return back.view(t, k, -1).sum(dim=1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, act_and_mul) -> torch.Tensor:
    """The torch reference: each token's k experts one at a time, in fp32."""
    t, k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            h = act_and_mul(x[i:i + 1].float() @ w13[e].float().t())
            out[i] += float(weights[i, j]) * (h @ w2[e].float().t())[0]
    return out.to(x.dtype)


__all__ = ["Segments", "fused_moe", "fused_moe_ref", "grouped_gemm"]
