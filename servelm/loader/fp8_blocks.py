"""Block-quantized fp8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8): read and dequantized at load.

Such a checkpoint's config.json says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

and each quantized linear stores float8_e4m3fn codes with one float32 scale per block of
weight_block_size (rows x columns), the last blocks of a dimension partial:

    X.weight            [N, K]  float8_e4m3fn
    X.weight_scale_inv  [ceil(N / bn), ceil(K / bk)]  float32
    W[n, k] = X.weight[n, k] * X.weight_scale_inv[n // bn, k // bk]

(the name says "inverse" from the quantizer's side: it multiplies the codes back). Tensors
without a scale (embeddings, norms, the router, the head) are stored in bf16 as usual.
servelm dequantizes each quantized weight as it is read, straight into the model's dtype
(bfloat16 where --dtype chose it), so everything after the loader sees a float checkpoint
(`--quantization int8|int4|fp8` can then quantize it its own way).

Owns reading quantization_config for this format and the dequantization. Never: accepts
another fp8 layout (per-tensor or per-channel scales, other names): refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(model_dir: Path) -> tuple[int, int] | None:
    """(rows, columns) of a block-quantized fp8 checkpoint's scale blocks; None when its
    config.json has no fp8 quantization_config. ValueError for an fp8 layout servelm does
    not read."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{path}: quantization_config.weight_block_size is {block!r}; servelm "
                         "reads fp8 checkpoints with block scales only ([rows, columns])")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{path}: quantization_config.fmt {fmt!r} is not supported (e4m3 only)")
    return block[0], block[1]


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               name: str = "weight", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W in `dtype` (the model's) from fp8 codes [N, K] and block scales [ceil(N/bn),
    ceil(K/bk)]: each product in float32, rounded once to dtype, one block row at a time,
    so a bfloat16 model never holds a float32 copy of the matrix (twice its bytes)."""
    bn, bk = block
    if weight.dim() != 2:
        raise ValueError(f"{name}: an fp8 block-quantized weight must be 2-D, got "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX} is {tuple(scale_inv.shape)}, expected {want} "
                         f"for a {n} x {k} weight in {bn} x {bk} blocks")
    scales = scale_inv.float().repeat_interleave(bk, 1)[:, :k]  # [ceil(N/bn), K]
    if dtype == torch.float32:
        return weight.float() * scales.repeat_interleave(bn, 0)[:n]
    out = torch.empty(n, k, dtype=dtype)
    for i, start in enumerate(range(0, n, bn)):
        rows = weight[start:start + bn]
        out[start:start + bn] = (rows.float() * scales[i]).to(dtype)
    return out


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as the checkpoints' tools do it (tests write checkpoints with it): codes
    [N, K] float8_e4m3fn and scales with each block's max magnitude mapped to 448."""
    bn, bk = block
    n, k = weight.shape
    w = weight.float()
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


__all__ = ["dequantize", "fp8_block_size", "is_scale", "quantize"]
