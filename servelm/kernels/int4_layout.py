"""The int4 weight layout of the Triton w4a16 GEMM: eight 4-bit codes to an int32 word along K.

Owns: packing codes into that layout and unpacking them (torch only, no triton), so the
quantized linear that stores it (quant/int4_linear.py) and the kernel's torch reference
(kernels/w4a16_gemm.py) share one definition from below both.
Never: quantizes (quant/int4_linear.py chooses codes, scales and zeros).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack_int4_along_k(q: torch.Tensor) -> torch.Tensor:
    """q[N, K] codes 0..15 -> [ceil(K / 8), N] int32, eight codes a word along K: nibble j of
    word [i, n] is q[n, 8 i + j] (the Triton w4a16 kernel's layout). Columns past K are 8."""
    n, k = q.shape
    words = -(-k // 8)
    codes = F.pad(q.to(torch.int64), (0, words * 8 - k), value=8).view(n, words, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (codes << shifts).sum(-1)  # [N, words] in 0 .. 2^32 - 1
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as int32 bits
    return packed.to(torch.int32).t().contiguous()


def unpack_int4_along_k(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4_along_k: [ceil(K / 8), N] int32 -> q[N, K] uint8."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed.t()[:, :, None] >> shifts) & 0xF  # [N, words, 8]
    return codes.reshape(packed.shape[1], -1)[:, :k].to(torch.uint8)
