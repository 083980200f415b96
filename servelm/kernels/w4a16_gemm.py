"""w4a16 GEMM: y = x @ W.T + bias with W int4, group-wise asymmetric, x in 16 (or 32) bits.

    W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group_size,  q in 0..15

(tinygemm's convention, as servelm/quant/int4_linear.py; GGUF Q4_0/Q4_1 map onto it.) The
codes are packed eight to an int32 along K, so a [BLOCK_K, BLOCK_N] tile of W is BLOCK_K / 8
rows of words, each word read once per tile:

    qweight: [ceil(K / 8), N] int32     nibble j (bits 4j..4j+3) of word [i, n] = q[n, 8i + j]
    scale, zero: [G, N]                 G = ceil(K / group_size); N contiguous

K need not be a multiple of 8, the group or the tile: columns past K are masked out of x
(their codes are 8, their weight `zero`, times x = 0). A K tile never straddles two groups
(BLOCK_K divides group_size), so a tile reads one scale and one zero per column.

Grid (ceil(M / BLOCK_M), ceil(N / BLOCK_N)); fp32 accumulation; the dequantized tile is cast
to the dot dtype (bf16/fp16 tensor cores on a GPU; see dot_dtype.py for the interpreter).
Block sizes are fixed, not autotuned: BLOCK_M 16 for decode-sized M (<= 16), else 64.

Owns the kernel, its launcher and its torch reference. Never packs weights (the layer does,
once, with servelm.kernels.int4_layout.pack_int4_along_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelm.kernels.dot_dtype import dot_dtype
from servelm.kernels.int4_layout import unpack_int4_along_k


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qk, stride_sg, stride_ym,
                  GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        words = tl.load(qw_ptr + (ks // 8)[:, None] * stride_qk + cols[None, :],
                        mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BK, BN] int32
        q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
        g = k0 // GROUP_SIZE  # the tile's one group
        scale = tl.load(scale_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = (q - 8).to(tl.float32) * scale[None, :] + zero[None, :]  # [BK, BN]
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None, block_n: int = 64
               ) -> torch.Tensor:
    """x: [M, K] (fp32/fp16/bf16); qweight: [ceil(K/8), N] int32; scale, zero: [G, N];
    bias: [N] or None -> y: [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    num_groups = -(-k // group_size)
    if qweight.shape[0] != -(-k // 8) or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [{-(-k // 8)}, N] for K={k}, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if scale.shape != (num_groups, n) or zero.shape != scale.shape:
        raise ValueError(f"scale/zero must be [{num_groups}, {n}], got {tuple(scale.shape)} and "
                         f"{tuple(zero.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = min(64, group_size)
    if group_size % block_k:
        raise ValueError(f"group_size must be a multiple of {block_k}, got {group_size}")
    block_m = 16 if m <= 16 else 64
    dot_t, precision = dot_dtype(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x, qweight, scale.contiguous(), zero.contiguous(), bias, y, m, n, k,
        x.stride(0), qweight.stride(0), scale.stride(0), y.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_t, DOT_PRECISION=precision)
    return y


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor, group_size: int, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Torch reference: unpack, dequantize to float32, matmul in float32 -> x's dtype."""
    k = x.shape[1]
    q = unpack_int4_along_k(qweight, k).float()  # [N, K]
    w = ((q - 8) * scale.float().t().repeat_interleave(group_size, dim=1)[:, :k]
         + zero.float().t().repeat_interleave(group_size, dim=1)[:, :k])
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
