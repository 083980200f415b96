"""Codes of community checkpoints (GPTQ, AWQ, compressed-tensors) as servelm's QuantizedWeights.

Owns: unpacking int32 words into codes, and the one conversion every format ends in: codes q
with a zero point z and a scale s per group of input columns,

    w[n, k] = (q[n, k] - z[n, g]) * s[n, g],   g = k // group_size

into servelm's int4 form `(q - 8) * scale + zero` (zero = (8 - z) s, one float32 product of a
small integer and the checkpoint's fp16/bf16 scale: exact), or its int8 form `q * scale` when
every zero point is the middle of the 8-bit range (symmetric). Group sizes servelm's int4
kernels do not take are fitted where that is exact (a scale per row, or groups that are a
multiple of 256, repeat their scale over 128- / 256-column groups) and refused otherwise.

Never: reads files or configs (the format modules do), or builds layers.
"""

from __future__ import annotations

import torch

from servelm.quant.int4_linear import GROUP_SIZES
from servelm.quant.quantized_weight import QuantizedWeight


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, num: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each along `dim` (code j of a word in bits
    [bits j, bits (j + 1)), the lowest first) -> int32 codes, `num` of them along `dim`."""
    per_word = 32 // bits
    words = packed.to(torch.int32)
    if dim == 0:
        return unpack_int32(words.t(), bits, 1, num).t().contiguous()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    return codes.reshape(words.shape[0], words.shape[1] * per_word)[:, :num]


def is_trivial_g_idx(g_idx: torch.Tensor | None, group_size: int, k: int) -> bool:
    """Whether a g_idx (group of each input column) is the plain k // group_size: act-order
    that left the columns in order, or a per-row quantization (one group)."""
    if g_idx is None:
        return True
    plain = torch.arange(k, dtype=torch.int64) // (group_size if group_size > 0 else k)
    return torch.equal(g_idx.to(torch.int64).flatten(), plain)


def group_order(g_idx: torch.Tensor, group_size: int, k: int) -> torch.Tensor | None:
    """The permutation of the input columns that makes each group's columns contiguous
    (act-order: columns sorted by group, stably), when the groups are then exactly
    k // group_size; None for a g_idx that sorts into anything else."""
    perm = torch.argsort(g_idx.to(torch.int64).flatten(), stable=True)
    return perm if is_trivial_g_idx(g_idx.flatten()[perm], group_size, k) else None


def dequantize_codes(q: torch.Tensor, zero_point: torch.Tensor, scale: torch.Tensor,
                     g_idx: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: (q - z[:, g_idx]) * s[:, g_idx]; q, z, s as [N, K] / [N, G]."""
    g = g_idx.to(torch.int64)
    return (q.float() - zero_point.float()[:, g]) * scale.float()[:, g]


def fit_group_size(group_size: int, k: int, param: str) -> tuple[int, int]:
    """(servelm's group size, how many of its groups one checkpoint group spans) for a
    checkpoint's group size; group_size <= 0 or >= k is one group a row (per channel)."""
    if group_size in GROUP_SIZES:  # also where it spans the whole row: one name a model
        return group_size, 1
    if group_size <= 0 or group_size >= k:
        return 128, -(-k // 128)
    if group_size % 256 == 0:
        return 256, group_size // 256
    raise ValueError(f"{param} {group_size} cannot be served: servelm's int4 groups are "
                     f"{GROUP_SIZES} (or a scale per row, or a multiple of 256)")


def int4_weight(q: torch.Tensor, zero_point: torch.Tensor, scale: torch.Tensor,
                group_size: int, param: str = "group_size") -> QuantizedWeight:
    """q [N, K] codes 0..15, zero_point (integers, 0..16: GPTQ v1 can say 16) and scale
    [N, G] with groups of group_size columns (<= 0: G = 1) -> an int4 QuantizedWeight."""
    n, k = q.shape
    group, span = fit_group_size(group_size, k, param)
    s = scale.float()
    zero = (8 - zero_point.float()) * s
    num_groups = -(-k // group)
    if span > 1 or s.shape[1] != num_groups:
        s = s.repeat_interleave(span, dim=1)[:, :num_groups]
        zero = zero.repeat_interleave(span, dim=1)[:, :num_groups]
    return QuantizedWeight("int4", q.to(torch.uint8).contiguous(), s.contiguous(),
                           zero.contiguous(), group).validate()


def int8_weight(q: torch.Tensor, zero_point: torch.Tensor | None, scale: torch.Tensor,
                group_size: int) -> QuantizedWeight | None:
    """q [N, K] signed codes (-128..127, zero_point subtracted by the caller's convention:
    here w = (q - zero_point) * scale) -> an int8 QuantizedWeight, or None when a zero point
    is not 0 (asymmetric 8-bit: servelm's int8 layers are symmetric)."""
    if zero_point is not None and bool((zero_point != 0).any()):
        return None
    n, k = q.shape
    if group_size <= 0 or group_size >= k or scale.shape[1] == 1:
        return QuantizedWeight("int8", q.to(torch.int8).contiguous(),
                               scale.reshape(n).contiguous(), None, 0).validate()
    return QuantizedWeight("int8", q.to(torch.int8).contiguous(), scale.float().contiguous(),
                           None, group_size).validate()
