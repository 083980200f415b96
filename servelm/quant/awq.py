"""AWQ checkpoints (AutoAWQ / llm-awq, GEMM layout): their config and tensors.

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": true, "version": "gemm"}

Each quantized linear `X` stores (K inputs, N outputs, eight 4-bit codes a word):

    X.qweight  int32 [K, N / 8]   codes packed along N in AWQ's interleaved order: nibble j
                                  (bits [4 j, 4 j + 4)) of word [k, i] is column 8 i + ORDER[j],
                                  ORDER = 0 2 4 6 1 3 5 7 (its GEMM kernel's dequant order)
    X.qzeros   int32 [G, N / 8]   zero points packed the same way
    X.scales   fp16  [G, N]

    W[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]

AWQ's scaling of activation channels is already folded into these weights (and into the
preceding norm), so the codes are all there is. Other `version`s (gemv, gemv_fast, marlin,
exllama, ipex) store the same codes in kernel-specific layouts and are refused by name, as is
`zero_point: false`.

Never: reads files (servelm/loader/community_checkpoint.py does) or builds layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from servelm.protocol import InvalidParameterError
from servelm.quant.community_codes import int4_weight, unpack_int32
from servelm.quant.quantized_weight import QuantizedWeight

SUFFIXES = ("qweight", "qzeros", "scales")
MARKER = "qweight"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQSpec(NamedTuple):
    group_size: int
    keep_act_order: bool = False  # AWQ has no act-order: unused


def parse_config(qc: dict[str, Any], where: str) -> AWQSpec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise InvalidParameterError(
            f"{where}: AWQ quantization_config.version {version!r} is not loaded (only the "
            "GEMM layout is; the others are kernel-specific packings)", param="model")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise InvalidParameterError(f"{where}: AWQ quantization_config.bits {bits!r} is not "
                                    "loaded (4 is)", param="model")
    if not qc.get("zero_point", True):
        raise InvalidParameterError(f"{where}: AWQ quantization_config.zero_point false is "
                                    "not loaded (AWQ's GEMM checkpoints store zero points)",
                                    param="model")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise InvalidParameterError(f"{where}: AWQ quantization_config.group_size {group!r} "
                                    "must be a positive integer or -1", param="model")
    return AWQSpec(group)


def _columns(packed: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] words -> [R, N] codes in column order."""
    codes = unpack_int32(packed, 4, 1, packed.shape[1] * 8)  # nibble order
    n = codes.shape[1]
    column = torch.arange(n).view(-1, 8)[:, list(ORDER)].reshape(-1)  # nibble p -> its column
    out = torch.empty_like(codes)
    out[:, column] = codes
    return out


def read_linear(spec: AWQSpec, get, name: str) -> QuantizedWeight:
    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    if qzeros is None or scales is None:
        raise ValueError(f"{name}: an AWQ linear needs qweight, qzeros and scales")
    q = _columns(qweight).t()  # [N, K]
    zeros = _columns(qzeros).t()  # [N, G]
    return int4_weight(q, zeros, scales.t(), spec.group_size, "AWQ group_size")
