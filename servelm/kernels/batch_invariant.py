"""Batch-invariant Triton kernels for deterministic mode on the GPU: a matmul and RMSNorm
whose result for one row is the same bits whatever else is in the batch.

Why cuBLAS is not: it picks a kernel, a tile shape and a split of K by M (the number of
rows), so one token's output row is summed in another order when the batch grows from 1 to
64, and its last bits move. These kernels fix every choice that shapes a row's sum:

    matmul   y[m, n] = sum over K in BLOCK_K tiles, taken in order 0, BLOCK_K, 2 BLOCK_K, ...
             one accumulator per output element, no split of K, no atomics; BLOCK_M, BLOCK_N,
             BLOCK_K fixed for every M (no autotuning, no "small M" variant), so row m of a
             tile is computed by the same instructions on the same K tiles at any M and at
             any place of the row in the batch
    rmsnorm  one program per row; the row's sum of squares in one tl.sum over the whole
             row (BLOCK = the next power of two of the hidden size), never split across
             programs

A tile's padding rows are zeros that no other row's sum touches. Rows are independent in
both kernels, so batch size, a row's position, the prompt's chunking and a padded CUDA graph
cannot change them.

Owns the two kernels, their launchers and torch references. Never: picks a faster
configuration by shape (that is exactly what would break the promise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype, is_interpreting

BLOCK_M = 32
BLOCK_N = 128
BLOCK_K = 64


@triton.jit
def _bi_matmul_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
                      stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K tiles in order: the one reduction order
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def bi_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x: [M, K]; w: [N, K] (a linear's weight, K contiguous); bias: [N] or None ->
    y = x @ w.T + bias: [M, N] in x's dtype, float32 accumulation, fixed tiles."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"w must be [N, {k}] with K contiguous, got {tuple(w.shape)} "
                         f"strides {w.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if m > 1 and is_interpreting():
        # The interpreter's tl.dot is numpy's matmul of the whole tile, and a BLAS GEMM may
        # sum a row's products in an order that depends on the row's place in the tile
        # (OpenBLAS's AVX2 sgemm does: rows 6-11 and 18-31 of a [32, 64] @ [64, 128] tile get
        # other bits than row 0 for the same data). So each row goes alone at the top of a
        # tile of its own, zeros below: the same numpy call on the same operands at any batch
        # size, on any CPU (M tiles instead of M / BLOCK_M; a GPU never takes this path).
        spread = x.new_zeros(m * BLOCK_M, k)
        spread[::BLOCK_M] = x
        return _launch(spread, w, bias)[::BLOCK_M].contiguous()
    return _launch(x, w, bias)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    dot_t, precision = dot_dtype(x.dtype)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _bi_matmul_kernel[grid](
        x, w, bias, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_DTYPE=dot_t, DOT_PRECISION=precision)
    return y


def bi_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _bi_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, N, eps,
                        stride_x, stride_res, stride_y, stride_res_out,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * stride_res_out + cols,
                 x.to(res_out_ptr.dtype.element_ty), mask=ok)
        # the norm reads the sum as stored (rounded to the activations' dtype), as the
        # unfused x + residual followed by a norm would
        x = tl.load(res_out_ptr + row * stride_res_out + cols, mask=ok, other=0.0
                    ).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=ok)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None):
    """As RMSNorm.forward: norm(x) without residual; (norm(x + residual), x + residual) with
    it. x, residual: [..., N]; weight: [N]."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
        res_out = torch.empty_like(y)
    if x2.shape[0]:
        _bi_rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, y, res_out, n, eps, x2.stride(0),
            res2.stride(0) if res2 is not None else 0, y.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    if residual is None:
        return y.view(shape)
    return y.view(shape), res_out.view(shape)


def bi_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, residual)


__all__ = ["bi_matmul", "bi_matmul_ref", "bi_rms_norm", "bi_rms_norm_ref"]
