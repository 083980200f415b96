"""Tiny GPTQ, AWQ and compressed-tensors checkpoints written from a float transformers model,
and each format's reference dequantization (import as `community_checkpoints`).

compressed-tensors checkpoints are written by the library itself (its ModelCompressor), and
the reference holds the weights its own decompressor reads back from the file. GPTQModel and
AutoAWQ need CUDA builds, so GPTQ and AWQ tensors are packed here as their documented layouts
say, with round-to-nearest codes (what GPTQ's solver
chooses does not change the layout), and the reference dequantizes them with the formulas
of GPTQModel's `dequantize_weight` and AutoAWQ's `dequantize_gemm` (awq/utils/
packing_utils.py), written out independently of servelm's reader.
"""

from __future__ import annotations

import copy
import json
import zlib

import torch
from safetensors.torch import load_file, save_file

from tiny_models import save_tiny_checkpoint

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("proj.weight") and "lm_head" not in name


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R / (32/bits), C] int32, code j of a word in bits [bits j, ...)."""
    per = 32 // bits
    r, c = codes.shape
    words = (codes.to(torch.int64).view(r // per, per, c)
             << (torch.arange(per) * bits).view(1, per, 1)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _rtn(w: torch.Tensor, bits: int, sym: bool, gid: torch.Tensor, num_groups: int):
    """Codes [N, K], zero points and fp16 scales [N, G] for groups gid[k] of columns."""
    maxq = (1 << bits) - 1
    n, _ = w.shape
    lo = torch.full((n, num_groups), float("inf")).scatter_reduce(
        1, gid.expand(n, -1), w, "amin")
    hi = torch.full((n, num_groups), float("-inf")).scatter_reduce(
        1, gid.expand(n, -1), w, "amax")
    if sym:
        scale = (torch.maximum(lo.abs(), hi.abs()) * 2 / maxq).clamp_min(1e-6).half()
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = ((hi - lo) / maxq).clamp_min(1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int64)
    q = torch.round(w / scale.float()[:, gid]) + zero[:, gid]
    return q.clamp(0, maxq).to(torch.int64), zero, scale


def gptq_tensors(w: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool,
                 v1: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """One linear [N, K] as GPTQ's qweight / qzeros / scales / g_idx."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    order = torch.arange(k)
    if act_order:  # columns quantized in some order: a group is every gs-th of that order
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs
    num_groups = -(-k // gs)
    q, zero, scale = _rtn(w.float(), bits, sym, g_idx, num_groups)
    stored = (zero - 1) & ((1 << bits) - 1) if v1 else zero  # AutoGPTQ's off-by-one
    return {"qweight": _pack_rows(q.t().contiguous(), bits),
            "qzeros": _pack_cols(stored.t().contiguous(), bits),
            "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] -> [R, C / (32/bits)] int32, packed along columns."""
    return _pack_rows(codes.t().contiguous(), bits).t().contiguous()


def gptq_reference(t: dict[str, torch.Tensor], bits: int, v1: bool = True) -> torch.Tensor:
    """GPTQModel's dequantize_weight: W [N, K] float32."""
    per, maxq = 32 // bits, (1 << bits) - 1
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    qzeros, qweight, scales = t["qzeros"], t["qweight"], t["scales"]
    zeros = (qzeros.unsqueeze(2).expand(-1, -1, per) >> wf.unsqueeze(0)) & maxq
    zeros = zeros.reshape(qzeros.shape[0], -1)[:, :scales.shape[1]] + (1 if v1 else 0)
    weight = (qweight.unsqueeze(1).expand(-1, per, -1) >> wf.unsqueeze(-1)) & maxq
    weight = weight.reshape(-1, weight.shape[2])
    g = t["g_idx"].long()
    return (scales.float()[g] * (weight - zeros[g]).float()).t().contiguous()


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One linear [N, K] as AWQ's GEMM qweight / qzeros / scales."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    gid = torch.arange(k) // gs
    q, zero, scale = _rtn(w.float(), 4, False, gid, -(-k // gs))

    def pack(codes):  # [R, C] -> [R, C / 8], nibble j holds column 8 i + AWQ_ORDER[j]
        r, c = codes.shape
        words = torch.zeros(r, c // 8, dtype=torch.int64)
        for j in range(8):
            words |= codes[:, AWQ_ORDER[j]::8] << (4 * j)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(zero.t().contiguous()),
            "scales": scale.t().contiguous()}


def awq_reference(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm (unpack_awq, reverse_awq_order): W [N, K] float32."""
    shifts = torch.arange(0, 32, 4)
    iweights = (t["qweight"][:, :, None] >> shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = (t["qzeros"][:, :, None] >> shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(iweights.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
    iweights, izeros = iweights[:, order] & 15, izeros[:, order] & 15
    k = iweights.shape[0]
    gs = k if group_size == -1 else group_size
    scales = t["scales"].float().repeat_interleave(gs, dim=0)[:k]
    izeros = izeros.repeat_interleave(gs, dim=0)[:k]
    return ((iweights - izeros).float() * scales).t().contiguous()


def _rewrite(hf, path, quantization_config, convert):
    """Save hf at path, each quantized linear's weight replaced by convert(name, W) -> its
    tensors (suffix -> tensor) and the reference W; returns the reference transformers model."""
    save_tiny_checkpoint(hf, path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    out, ref_state = {}, {}
    for name, t in tensors.items():
        if _is_quantized(name, t):
            parts, ref = convert(name, t)
            base = name.removesuffix(".weight")
            out.update({f"{base}.{s}": v for s, v in parts.items()})
            ref_state[name] = ref
        else:
            out[name] = t
            ref_state[name] = t
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))
    return _reference_model(hf, path, ref_state)


def _reference_model(hf, path, state):
    """transformers' model of `state` (checkpoint names), loaded from a directory beside
    path by from_pretrained, which maps the names to its own layout (fused MoE experts)."""
    ref_dir = path.parent / (path.name + "-dequantized")
    hf.save_pretrained(ref_dir, safe_serialization=True)
    for file in ref_dir.glob("*.safetensors"):
        file.unlink()
    save_file({n: t.contiguous() for n, t in state.items()}, str(ref_dir / "model.safetensors"))
    return type(hf).from_pretrained(ref_dir, dtype=torch.float32).eval()


def _input_of(name: str, shared: bool) -> str:
    """The key act-order's column order follows: GPTQ orders by the Hessian of the layer's
    input, so q/k/v (and gate/up) share one order; `shared=False` gives each its own."""
    if shared:
        for a, b in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
            name = name.replace(a, b)
    return name


def write_gptq(hf, path, bits=4, group_size=128, sym=True, act_order=False, v1=True,
               shared_order=True):
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
          "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}

    def convert(name, w):
        seed = zlib.crc32(_input_of(name, shared_order).encode())
        t = gptq_tensors(w, bits, group_size, sym, act_order, v1, seed=seed)
        return t, gptq_reference(t, bits, v1)

    return _rewrite(hf, path, qc, convert)


def write_awq(hf, path, group_size=128):
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": None}

    def convert(name, w):
        t = awq_tensors(w, group_size)
        return t, awq_reference(t, group_size)

    return _rewrite(hf, path, qc, convert)


def write_compressed_tensors(hf, path, num_bits=4, strategy="group", group_size=32,
                             symmetric=True, activations=False):
    """hf quantized by compressed-tensors (RTN scales from its calculate_qparams) and saved
    compressed: pack-quantized for 4 bits, int-quantized for 8 (W8A8 with dynamic per-token
    activations when `activations`). Returns transformers' model of the weights the library
    decompresses the checkpoint to."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    config = copy.deepcopy(hf.config)  # the float model's, for the reference
    wargs = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric,
                             strategy=strategy,
                             group_size=group_size if strategy == "group" else None)
    aargs = (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                              dynamic=True) if activations else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=["lm_head"]))
    for module in hf.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        n, k = w.shape
        wg = w.view(n, k // group_size, group_size) if strategy == "group" else w.view(n, 1, k)
        scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), wargs)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
    fmt = "pack-quantized" if num_bits == 4 else "int-quantized"
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    save_tiny_checkpoint(hf, path)
    compressor.update_config(str(path))
    return _decompressed_reference(path, config, fmt, scheme)


def _decompressed_reference(path, config, fmt, scheme):
    """transformers' model of the checkpoint's weights as compressed-tensors' own
    decompressor gives them back (transformers' loader would also quantize activations on
    the fly for W8A8, and in this version mis-shapes packed asymmetric zero points)."""
    import transformers
    from compressed_tensors.compressors.base import BaseCompressor

    tensors = load_file(str(path / "model.safetensors"))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    modules = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale")}
    state = {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in modules}
    for m in modules:
        local = {n.rpartition(".")[2]: t for n, t in tensors.items()
                 if n.rpartition(".")[0] == m}
        state[f"{m}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    hf = transformers.AutoModelForCausalLM.from_config(config)
    return _reference_model(hf, path, state)
