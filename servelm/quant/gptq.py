"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): their config and tensors.

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true, "checkpoint_format": "gptq"}

Each quantized linear `X` stores (K inputs, N outputs, bits 4 or 8, 32 / bits codes a word):

    X.qweight  int32 [K / (32/bits), N]   codes packed along K: code j of word [i, n] is
                                          column k = i (32/bits) + j, bits [bits j, bits j + bits)
    X.qzeros   int32 [G, N / (32/bits)]   zero points packed the same way along N
    X.scales   fp16  [G, N]
    X.g_idx    int32 [K]                  the group of each input column (optional)
    X.bias     [N]                        (optional; AutoGPTQ saved zeros for bias-free layers)

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

with z the stored zero point plus one in the original format ("checkpoint_format" or
GPTQModel's "format": "gptq", or none: AutoGPTQ subtracted 1 before packing, so a stored 15
reads back as 16, the "v1 off-by-one" every GPTQ kernel reproduces) and as stored in
GPTQModel's "gptq_v2". Older AutoGPTQ checkpoints keep these fields in quantize_config.json
beside config.json (servelm/loader/quantized_checkpoint.py reads it there).

Act-order (`desc_act`) quantizes columns in the order of the Hessian's diagonal, so g_idx
scatters each group's columns over the row. servelm's int4 kernels take groups of
contiguous columns, so the codes' columns are sorted by group once here and the layer
gathers its activations into that order each call (a `perm`: servelm/quant/
permuted_linear.py; exact, and a 4-bit layer's bytes, where float would be 8x them). A g_idx
that is the plain k // group_size (act-order with one group a row, or columns left in order)
needs no perm. Where the method building the layers cannot take a perm (a family's
registered int4-gN fallback, servelm/loader/community_checkpoint.py), such a layer is
dequantized to float instead: exact, at float's bytes.

Never: reads files (servelm/loader/community_checkpoint.py does) or builds layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from servelm.protocol import InvalidParameterError
from servelm.quant.community_codes import (dequantize_codes, group_order, int4_weight,
                                           int8_weight, is_trivial_g_idx, unpack_int32)
from servelm.quant.quantized_weight import QuantizedWeight

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
MARKER = "qweight"  # a module holding this tensor is a quantized linear
_FORMATS = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 0}  # checkpoint_format -> added to zeros


class GPTQSpec(NamedTuple):
    bits: int
    group_size: int  # -1: one group a row
    zero_offset: int  # 1 for the original (v1) zero points, 0 for v2
    keep_act_order: bool = False  # act-order codes kept with a perm (else dequantized)


def parse_config(qc: dict[str, Any], where: str) -> GPTQSpec:
    """The fields servelm reads; InvalidParameterError (param "model") naming the field of a
    variant it does not load."""
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (4, 8):
        raise InvalidParameterError(
            f"{where}: GPTQ quantization_config.bits {bits!r} is not loaded (4 and 8 are; "
            "2- and 3-bit codes have no servelm kernel)", param="model")
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise InvalidParameterError(f"{where}: GPTQ quantization_config.group_size {group!r} "
                                    "must be a positive integer or -1", param="model")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))  # GPTQModel writes either
    if fmt not in _FORMATS:
        raise InvalidParameterError(
            f"{where}: GPTQ quantization_config.checkpoint_format {fmt!r} is not loaded "
            f"({sorted(_FORMATS)} are; marlin / bitblas layouts are kernel-specific repacks "
            "of the same codes: convert back with GPTQModel)", param="model")
    return GPTQSpec(bits, group, _FORMATS[fmt])


def read_linear(spec: GPTQSpec, get, name: str) -> QuantizedWeight | torch.Tensor:
    """One linear's weight from its tensors (`get(suffix)` -> tensor or None): codes where
    servelm's layers hold them exactly, else the float32 weight (see the module docstring)."""
    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    if qzeros is None or scales is None:
        raise ValueError(f"{name}: a GPTQ linear needs qweight, qzeros and scales")
    per_word = 32 // spec.bits
    k, n = qweight.shape[0] * per_word, scales.shape[1]
    g_idx = get("g_idx")
    if g_idx is not None:
        k = g_idx.numel()
    q = unpack_int32(qweight, spec.bits, 0, k).t()  # [N, K]
    zeros = (unpack_int32(qzeros, spec.bits, 1, n) + spec.zero_offset).t()  # [N, G]
    scale = scales.t()
    if g_idx is None:
        g_idx = torch.arange(k) // (spec.group_size if spec.group_size > 0 else k)
    perm = None
    if not is_trivial_g_idx(g_idx, spec.group_size, k):
        perm = group_order(g_idx, spec.group_size, k) if spec.keep_act_order else None
        if perm is None:
            return dequantize_codes(q, zeros, scale, g_idx)
    codes = q if perm is None else q[:, perm]
    if spec.bits == 4:
        weight = int4_weight(codes, zeros, scale, spec.group_size, "GPTQ group_size")
    else:
        weight = int8_weight(codes - 128, zeros - 128, scale, spec.group_size)
        if weight is None:  # asymmetric 8-bit
            return dequantize_codes(q, zeros, scale, g_idx)
    return weight if perm is None else weight._replace(perm=perm).validate()
