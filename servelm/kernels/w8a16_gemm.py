"""w8a16 GEMM: y = (x @ q.T) * scale + bias with q int8 (one scale per output row), x in
16 (or 32) bits.

    W[n, k] = q[n, k] * scale[n]        q: [N, K] int8 as Int8Linear stores it (K contiguous)

The scale is per output row, so it factors out of the sum: the kernel multiplies raw codes
(int8 -> the dot dtype is exact: |q| <= 127 fits bf16's and fp16's mantissas) and scales the
fp32 accumulator once per tile. No repacking: the codes the CPU path uses are read as they are.

Grid (ceil(M / BLOCK_M), ceil(N / BLOCK_N)); fixed, untuned blocks: BLOCK_M 16 for M <= 16.

Owns the kernel, its launcher and its torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qn, stride_ym, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        q = tl.load(q_ptr + cols[None, :] * stride_qn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BK, BN] int8
        acc += tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, block_n: int = 64, block_k: int = 64
               ) -> torch.Tensor:
    """x: [M, K] (fp32/fp16/bf16); q: [N, K] int8 (K contiguous); scale: [N]; bias: [N] or
    None -> y: [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    if q.dtype != torch.int8 or q.shape[1] != k or q.stride(1) != 1:
        raise ValueError(f"q must be int8 [N, {k}] with K contiguous, got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if scale.shape != (n,):
        raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 64
    dot_t, precision = dot_dtype(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x, q, scale, bias, y, m, n, k, x.stride(0), q.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_t, DOT_PRECISION=precision)
    return y


def w8a16_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: dequantize to float32, matmul in float32 -> x's dtype."""
    y = x.float() @ (q.float() * scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
