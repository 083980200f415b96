"""CodesMethod: the quantization method of a community checkpoint (`gptq`, `awq`,
`compressed-tensors`), which builds the layers from the checkpoint's own codes.

Each linear arrives as a QuantizedWeight (servelm/quant/community_codes.py) and becomes the
layer of its format: int4 with any group size servelm's kernels take -> Int4Linear (float32
scale and zero: exactly the checkpoint's weights), int8 per row or per group -> Int8Linear
(a per-row scale kept in float32 where bfloat16 would round it); act-order codes (with a
`perm`) -> that layer inside a PermutedLinear. A linear the checkpoint stores as float, or
that its reader dequantized (asymmetric 8-bit), stays a float layer, and so does the
lm_head: its publisher left it unquantized, and servelm computes the model the checkpoint
describes rather than requantizing parts of it.

Never: quantizes a float weight. `--quantization gptq` (or awq, compressed-tensors) on
anything but such a checkpoint is refused where the engine is built
(servelm/loader/community_checkpoint.py says which checkpoints those are).
"""

from __future__ import annotations

import torch

from servelm.quant.int4_linear import GROUP_SIZES, Int4Linear
from servelm.quant.int8_linear import Int8Linear
from servelm.quant.methods import QuantMethod, float_linear
from servelm.quant.quantized_weight import QuantizedWeight


class CodesMethod(QuantMethod):
    """Layers from a checkpoint's codes as they are; float weights stay float."""

    def from_blocks(self, blocks, bias, dtype=torch.float32):
        if not isinstance(blocks, QuantizedWeight):
            raise ValueError(f"quantization {self.name!r} takes a {self.name} checkpoint's "
                             "codes, not GGUF blocks")
        return self.build(blocks, bias)

    def quantize(self, weight):
        return weight  # a float weight stays float (see the module docstring)

    def accepted_formats(self):
        return ("int8", "int8-gN", *(f"int4-g{g}" for g in GROUP_SIZES))

    def lm_head_method(self):
        return None

    def build(self, weight, bias):
        if not isinstance(weight, QuantizedWeight):
            return float_linear(weight, bias)
        return self.by_rows(lambda acts: self._layer(weight, bias, acts))

    def _layer(self, weight: QuantizedWeight, bias, activations: str):
        if weight.perm is not None:  # act-order: codes in group order (permuted_linear.py)
            from servelm.quant.permuted_linear import PermutedLinear

            inner = self._layer(weight._replace(perm=None), bias, activations)
            return PermutedLinear(inner, weight.perm)
        if weight.format == "int4":
            return Int4Linear(weight.q, weight.scale, weight.zero, weight.group_size, bias,
                              self.compute_dtype, activations=activations)
        compute = self.compute_dtype
        if not weight.group_size and not torch.equal(
                weight.scale.to(compute).float(), weight.scale.float()):
            compute = torch.float32  # Int8Linear keeps a per-row scale in its compute dtype
        return Int8Linear(weight.q, weight.scale.float(), bias, compute,
                          group_size=weight.group_size, activations=activations)
