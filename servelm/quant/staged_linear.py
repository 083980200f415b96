"""StagedLinear: a linear layer's weights while they load, before its method quantizes them.

Why staged: q/k/v and gate/up arrive as separate checkpoint tensors and are fused into one
matrix, and RTN scales must see the fused rows' final values. So the model copies float shards
into `weight` as it would for nn.Linear (or hands GGUF blocks, or the QuantizedWeights of a
pre-quantized checkpoint, to `load_blocks`), and `finalize_linears` builds the real layer once
everything is in. `quantized_weight()` is what `servelm quantize` saves instead.

Never: runs a forward pass (it raises: a model used before finalize is a bug).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from servelm.quant.gguf_blocks import GGUFBlocks, cat_rows
from servelm.quant.quantized_weight import QuantizedWeight, cat_quantized_rows

logger = logging.getLogger(__name__)


class StagedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        # first row -> raw GGUF blocks (or pre-quantized codes) of those rows
        self._blocks: dict[int, GGUFBlocks | QuantizedWeight] = {}

    def load_blocks(self, blocks: GGUFBlocks | QuantizedWeight, row_offset: int) -> None:
        self._blocks[row_offset] = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("StagedLinear has not been finalized: call "
                           "servelm.quant.finalize_linears(model) after loading the weights")

    def finalize(self) -> nn.Module:
        bias = None if self.bias is None else self.bias.data
        parts = row_parts(self._blocks, self.out_features)
        if (parts is not None and self.quant.keeps_block_types and len(parts) > 1
                and all(isinstance(p, GGUFBlocks) for _, p in parts)
                and len({p.type_name for _, p in parts}) > 1):
            return self._parts_layer(parts, bias)
        blocks = self._whole_blocks()
        if blocks is not None:
            # Decode where the layer will run: a layer's kernel (and its codes' layout) is
            # chosen by the device its codes are on (Int4Linear: Triton on CUDA).
            blocks = _to_device(blocks, self.weight.device)
            return self.quant.from_blocks(blocks, bias, dtype=self.weight.dtype)
        for row, b in self._blocks.items():  # mixed types or partial: go through float
            self.weight.data[row:row + b.shape[0]].copy_(b.dequantize())
        return self.quant.from_float(self.weight.data, bias)

    def _parts_layer(self, parts: list[tuple[int, GGUFBlocks]], bias) -> nn.Module:
        """GGUF parts of different types (a Q4_K_M file's Q4_K q/k beside its Q6_K v): each
        built as its own layer, side by side (servelm/quant/row_parts_linear.py)."""
        from servelm.quant.row_parts_linear import RowPartsLinear

        layers = []
        for row, part in parts:
            part_bias = None if bias is None else bias[row:row + part.shape[0]]
            layers.append(self.quant.from_blocks(_to_device(part, self.weight.device),
                                                 part_bias, dtype=self.weight.dtype))
        return _parts_by_rows(layers)

    def quantized_weight(self):
        """The codes (QuantizedWeight) or float weight `finalize` builds its layer from, as
        the method's `quantize` gives them: `build(quantized_weight())` is `finalize()`."""
        blocks = self._whole_blocks()
        if isinstance(blocks, QuantizedWeight):
            return blocks
        if blocks is not None:
            return self.quant.quantize_blocks(blocks, dtype=self.weight.dtype)
        for row, b in self._blocks.items():
            self.weight.data[row:row + b.shape[0]].copy_(b.dequantize())
        return self.quant.quantize(self.weight.data)

    def _whole_blocks(self) -> GGUFBlocks | QuantizedWeight | None:
        """The fused raw blocks when every row came as blocks of one supported type."""
        return fuse_row_blocks(self._blocks, self.out_features)


def _parts_by_rows(layers: list[nn.Module]) -> nn.Module:
    """The fused layer of `layers`' rows. Parts with a form per step's rows (MixedLinear,
    --quant-activations auto) make the fused layer two: the parts' large-step forms side by
    side and their small-step forms (a part of one form in both, shared), so that a step
    takes one form through every part, as the decode stack takes a layer's."""
    from servelm.quant.decode_entry import forms, is_mixed
    from servelm.quant.mixed_linear import MixedLinear
    from servelm.quant.row_parts_linear import RowPartsLinear

    mixed = [m.max_rows for m in layers if is_mixed(m)]
    if not mixed:
        return RowPartsLinear(layers)
    if len(set(mixed)) > 1:
        raise ValueError(f"row parts switch forms at different rows {sorted(set(mixed))}")
    return MixedLinear(RowPartsLinear([forms(m)["full"] for m in layers]),
                       RowPartsLinear([forms(m)["small"] for m in layers]), mixed[0])


def fuse_row_blocks(parts: dict[int, GGUFBlocks | QuantizedWeight], num_rows: int
                    ) -> GGUFBlocks | QuantizedWeight | None:
    """Row shards {first row: blocks} of one weight fused into one, when they cover its
    num_rows rows contiguously with one type; None otherwise (with a warning: the layer is
    then built from the float values) or when there are none."""
    if not parts:
        return None
    blocks = [p for _, p in sorted(parts.items())]
    if row_parts(parts, num_rows) is None or len({p.type_name for p in blocks}) != 1:
        logger.warning("%d x %d layer: GGUF shards of types %s are requantized from float",
                       num_rows, blocks[0].shape[1], sorted({p.type_name for p in blocks}))
        return None
    if isinstance(blocks[0], QuantizedWeight):
        return cat_quantized_rows(blocks)
    return cat_rows(blocks)


def row_parts(parts: dict[int, GGUFBlocks | QuantizedWeight], num_rows: int
              ) -> list[tuple[int, GGUFBlocks | QuantizedWeight]] | None:
    """The shards sorted by first row when they cover num_rows rows contiguously, else None."""
    ordered = sorted(parts.items())
    covered = 0
    for row, part in ordered:
        if row != covered:
            return None
        covered += part.shape[0]
    return ordered if ordered and covered == num_rows else None


def _to_device(blocks: GGUFBlocks | QuantizedWeight, device: torch.device
               ) -> GGUFBlocks | QuantizedWeight:
    if isinstance(blocks, GGUFBlocks):
        return blocks._replace(data=blocks.data.to(device))
    zero = None if blocks.zero is None else blocks.zero.to(device)
    return blocks._replace(q=blocks.q.to(device), scale=blocks.scale.to(device), zero=zero)


def make_linear(in_features: int, out_features: int, bias: bool, quant, is_lm_head: bool):
    if quant is not None and is_lm_head:
        quant = quant.lm_head_method()
    if quant is None:
        layer = nn.Linear(in_features, out_features, bias=bias)
        layer.requires_grad_(False)
        return layer
    return StagedLinear(in_features, out_features, bias, quant)


def finalize_linears(model: nn.Module) -> None:
    staged = [(name, m) for name, m in model.named_modules() if isinstance(m, StagedLinear)]
    for name, module in staged:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module.finalize())
