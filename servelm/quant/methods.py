"""QuantMethod and the registered methods: how a float weight or GGUF blocks become a layer.

Never: touches the model; `servelm.quant.make_linear` / `finalize_linears` call these.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.quant.gguf_blocks import GGUFBlocks, decode_q4
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_head import Int8Head
from servelm.quant.int8_linear import Int8Linear


class QuantMethod:
    """A named way to build linear layers; one instance is shared by a whole model.

    compute_dtype: the activations' dtype inside the quantized ops (bf16: the fast CPU path).
    """

    def __init__(self, name: str, compute_dtype: torch.dtype = torch.bfloat16):
        self.name = name
        self.compute_dtype = compute_dtype

    def from_float(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        raise NotImplementedError

    def from_blocks(self, blocks: GGUFBlocks, bias: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> nn.Module:
        """RTN methods given GGUF blocks quantize their float values (a round trip)."""
        return self.from_float(blocks.dequantize().to(dtype), bias)

    def lm_head_method(self) -> QuantMethod | None:
        """How the lm_head (tied or not) is quantized; None keeps it float.

        int8 (Int8Head) for every method: the head is ~20% of a small model's weights (28M of
        SmolLM2's 135M), so it must shrink for a decode step to read few bytes, but int4 there
        costs more quality than in the blocks (an error in a logit is an error in the answer).
        """
        return Int8HeadMethod("int8-head", self.compute_dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.compute_dtype})"


class Int8Method(QuantMethod):
    def from_float(self, weight, bias):
        return Int8Linear.from_float(weight, bias, self.compute_dtype)


class Int8HeadMethod(QuantMethod):
    """int8 with near-max logits recomputed in float32 (see int8_head.py)."""

    def from_float(self, weight, bias):
        return Int8Head.from_float(weight, bias, self.compute_dtype)

    def lm_head_method(self):
        return self


class Int4Method(QuantMethod):
    def __init__(self, name: str, group_size: int = 128,
                 compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(name, compute_dtype)
        self.group_size = group_size

    def from_float(self, weight, bias):
        return Int4Linear.from_float(weight, bias, self.group_size, self.compute_dtype)


class GGUFMethod(QuantMethod):
    """A GGUF file's quantized tensors served as they are stored.

    Q4_0 / Q4_1 -> Int4Linear with groups of 32: the nibbles are the kernel's codes as they
    are, (d, m) become (scale, zero = m + 8 d), rounded to the compute dtype (bf16: within
    ~2^-9 relative; float32: exact up to the one rounding of m + 8 d).
    Q8_0 -> Int8Linear with one scale per row, requantized from the dequantized blocks: no CPU
    int8 op takes a scale per 32 weights, and int4 would lose precision. The extra error is at
    most ~max|w_row| / 254 per weight, the same as int8 RTN of the float values.
    Other types (F32, F16, K-quants) are dequantized and stay float.
    """

    def from_blocks(self, blocks, bias, dtype=torch.float32):
        if blocks.type_name in ("Q4_0", "Q4_1"):
            q, scale, zero = decode_q4(blocks)
            return Int4Linear(q, scale, zero, 32, bias, self.compute_dtype)
        return Int8Linear.from_float(blocks.dequantize(), bias, self.compute_dtype)

    def from_float(self, weight, bias):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                          device=weight.device, dtype=weight.dtype)
        layer.requires_grad_(False)
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer
