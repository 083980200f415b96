"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A8): their config and tensors.

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4,
            "type": "int", "symmetric": true, "strategy": "group", "group_size": 128},
            "input_activations": null}},
        "ignore": ["lm_head"], "quantization_status": "compressed"}

Formats servelm reads (per quantized linear `X`, N outputs, K inputs):

    pack-quantized   X.weight_packed      int32 [N, ceil(K bits / 32)]: codes + 2^(bits-1)
                                          packed along K, element k at bits [bits k, ...) of
                                          the row's bit string (4 bits: nibble j of word i is
                                          column 8 i + j)
                     X.weight_shape       [N, K]
                     X.weight_scale       [N, G] (group) or [N, 1] (channel)
                     X.weight_zero_point  int32 [ceil(N / 8), G], packed along N the same way
                                          (asymmetric only)
                     X.weight_g_idx       [K] (actorder, optional: kept as GPTQ's)
    int-quantized /  X.weight             int8 [N, K]
    naive-quantized  X.weight_scale       [N, 1] | [N, G] | [1];  X.weight_zero_point (zeros)

    W[n, k] = (q[n, k] - zero_point[n, g]) * weight_scale[n, g]   (q, zero_point signed)

W8A8's activation quantization (input_activations: int8, dynamic per token, or a static
input_scale) is not reproduced: servelm's int8 layers compute with float activations, or
with its own int8 activations per 32 columns under `--quant-activations int8`; the
checkpoint's input scales are read past. A scheme with float (fp8 / fp4) weights or
activations, a sparsity or transform config, or another format is refused by name.

Never: reads files (servelm/loader/community_checkpoint.py does) or builds layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from servelm.protocol import InvalidParameterError
from servelm.quant.community_codes import (dequantize_codes, group_order, int4_weight,
                                           int8_weight, is_trivial_g_idx, unpack_int32)
from servelm.quant.quantized_weight import QuantizedWeight

SUFFIXES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
            "weight_g_idx", "weight")
MARKER = "weight_scale"
# read past: activation and KV-cache scales servelm does not use (see the module docstring)
SKIPPED = ("input_scale", "input_zero_point", "input_global_scale", "output_scale",
           "output_zero_point", "k_scale", "v_scale")
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


class CTSpec(NamedTuple):
    group_sizes: tuple[int, ...]  # of the config groups' weights (0: channel / tensor)
    keep_act_order: bool = False  # actorder codes kept with a perm (else dequantized)


def _check_args(args: dict[str, Any] | None, what: str, where: str) -> None:
    if args is None:
        return
    if args.get("type", "int") != "int":
        raise InvalidParameterError(
            f"{where}: compressed-tensors {what}.type {args.get('type')!r} is not loaded "
            "(int weights and activations are; fp8 / fp4 schemes are not)", param="model")
    if what == "weights":
        if args.get("num_bits") not in (4, 8):
            raise InvalidParameterError(f"{where}: compressed-tensors weights.num_bits "
                                        f"{args.get('num_bits')!r} is not loaded (4 and 8 "
                                        "are)", param="model")
        if args.get("strategy") not in ("group", "channel", "tensor"):
            raise InvalidParameterError(f"{where}: compressed-tensors weights.strategy "
                                        f"{args.get('strategy')!r} is not loaded (group, "
                                        "channel and tensor are)", param="model")


def parse_config(qc: dict[str, Any], where: str) -> CTSpec:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    formats = {fmt} | {g.get("format") for g in groups.values() if g.get("format")}
    formats -= {None, "mixed-precision"}  # mixed: each config group names its own
    bad = sorted(f for f in formats if f not in FORMATS)
    if bad:
        raise InvalidParameterError(
            f"{where}: compressed-tensors format {bad[0]!r} is not loaded ({FORMATS} are)",
            param="model")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise InvalidParameterError(
            f"{where}: compressed-tensors quantization_status "
            f"{qc.get('quantization_status')!r} is not loaded (compressed is)", param="model")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise InvalidParameterError(f"{where}: compressed-tensors {field} is not loaded "
                                        "(sparse and rotated checkpoints are refused)",
                                        param="model")
    if qc.get("kv_cache_scheme"):
        raise InvalidParameterError(f"{where}: compressed-tensors kv_cache_scheme is not "
                                    "loaded (servelm's KV cache takes --kv-cache-dtype)",
                                    param="model")
    sizes = []
    for group in groups.values():
        _check_args(group.get("weights"), "weights", where)
        _check_args(group.get("input_activations"), "input_activations", where)
        weights = group.get("weights") or {}
        sizes.append(int(weights.get("group_size") or 0)
                     if weights.get("strategy") == "group" else 0)
    if not sizes:
        raise InvalidParameterError(f"{where}: compressed-tensors config_groups is empty",
                                    param="model")
    return CTSpec(tuple(sorted(set(sizes))))


def _group_size(spec: CTSpec, k: int, num_groups: int, name: str) -> int:
    if num_groups == 1:
        return 0
    for size in spec.group_sizes:
        if size > 0 and -(-k // size) == num_groups:
            return size
    raise ValueError(f"{name}: {num_groups} scale groups over {k} columns match no "
                     f"config group's group_size {spec.group_sizes}")


def read_linear(spec: CTSpec, get, name: str) -> QuantizedWeight | torch.Tensor:
    scale = get("weight_scale")
    packed = get("weight_packed")
    if packed is None:  # int-quantized: int8 codes as they are
        q = get("weight")
        if q is None or q.dtype != torch.int8:
            raise ValueError(f"{name}: a compressed-tensors linear needs weight_packed or "
                             "an int8 weight")
        n, k = q.shape
        scale = _per_row(scale, n)
        zp = get("weight_zero_point")
        zp = None if zp is None else _per_row(zp, n).to(torch.int32) + 128
        gs = _group_size(spec, k, scale.shape[1], name)
        return _finish(spec, q.to(torch.int32) + 128, zp, scale, gs, 8, get("weight_g_idx"))
    n, k = (int(v) for v in get("weight_shape").tolist())
    bits = 4 if packed.shape[1] == -(-k // 8) else 8
    q = unpack_int32(packed, bits, 1, k)  # codes + 2^(bits-1), as stored
    scale = _per_row(scale, n)
    zp = get("weight_zero_point")
    if zp is not None:
        zp = unpack_int32(zp, bits, 0, n)  # [N, G], offset as the codes
    gs = _group_size(spec, k, scale.shape[1], name)
    return _finish(spec, q, zp, scale, gs, bits, get("weight_g_idx"))


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G] from [N, G], [N] or a per-tensor [1] / scalar."""
    return t.reshape(1, 1).expand(n, 1).contiguous() if t.numel() == 1 else t.reshape(n, -1)


def _finish(spec: CTSpec, q, zp_unsigned, scale, group_size, bits, g_idx):
    """q and zero points with the 2^(bits-1) offset (unsigned) -> the weight; act-order
    codes are kept with a perm, as GPTQ's (servelm/quant/gptq.py)."""
    mid = 1 << (bits - 1)
    n, k = q.shape
    zp = (torch.full((n, scale.shape[1]), mid, dtype=torch.int32) if zp_unsigned is None
          else zp_unsigned.to(torch.int32))
    if g_idx is None:
        g_idx = torch.arange(k) // (group_size if group_size > 0 else k)
    perm = None
    if not is_trivial_g_idx(g_idx, group_size, k):
        perm = group_order(g_idx, group_size, k) if spec.keep_act_order else None
        if perm is None:
            return dequantize_codes(q, zp, scale, g_idx)
    codes = q if perm is None else q[:, perm]
    if bits == 4:
        weight = int4_weight(codes, zp, scale, group_size, "compressed-tensors group_size")
    else:
        weight = int8_weight(codes - mid, zp - mid, scale, group_size)
        if weight is None:  # asymmetric 8-bit
            return dequantize_codes(q, zp, scale, g_idx)
    return weight if perm is None else weight._replace(perm=perm).validate()
