"""QuantMethod and the registered methods: how a float weight or GGUF blocks become a layer.

Methods that can be saved (`servelm quantize`) split that in two: `quantize` (float weight or
blocks -> a QuantizedWeight of codes and scales, or a float tensor for a layer that stays
float) and `build` (that -> the layer). Loading a pre-quantized checkpoint calls only `build`,
and quantizing at load time is `build(quantize(w))`, so both give the same layer.

Never: touches the model; `servelm.quant.make_linear` / `finalize_linears` call these.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.quant.gguf_blocks import KQUANT_BYTES, GGUFBlocks, decode_q4, decode_q5_0, decode_q8_0
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_head import Int8Head
from servelm.quant.int4_linear import quantize_int4_groups
from servelm.quant.int8_linear import (Int8Linear, quantize_int8_groups,
                                       quantize_int8_per_channel)
from servelm.quant.quantized_weight import QuantizedWeight


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A frozen nn.Linear holding a copy of `weight` (and `bias`), in their dtype: what a
    method builds for a layer that stays float."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      device=weight.device, dtype=weight.dtype)
    layer.requires_grad_(False)
    layer.weight.copy_(weight)
    if bias is not None:
        layer.bias.copy_(bias)
    return layer


def runs_int8(layer: nn.Module) -> bool:
    """Whether `layer` (or a layer it holds) computes with int8 activations."""
    return any(getattr(m, "activations", None) == "int8" for m in layer.modules())


class QuantMethod:
    """A named way to build linear layers; one instance is shared by a whole model.

    compute_dtype: the activations' dtype inside the quantized ops (bf16: the fast CPU path).
    activations: "float", "int8" or "auto" (servelm/quant/int8_act.py): what the CPU kernels
    round the activations to ("auto": by each step's rows, `by_rows`); the lm_head's method
    gets the same.
    """

    # GGUF shards of one fused layer in different types become one layer each, side by
    # side (servelm/quant/row_parts_linear.py), rather than one layer from their float values
    keeps_block_types = False

    def __init__(self, name: str, compute_dtype: torch.dtype = torch.bfloat16,
                 activations: str = "float"):
        from servelm.config.quant_choices import check_quant_activations

        self.name = name
        self.compute_dtype = compute_dtype
        self.activations = check_quant_activations(activations)

    def from_float(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return self.build(self.quantize(weight), bias)

    def check_device(self, device: torch.device) -> None:
        """Raise InvalidParameterError (param 'quantization') if the method cannot run on
        `device`; every weight-only method runs anywhere."""

    def from_blocks(self, blocks: GGUFBlocks | QuantizedWeight, bias: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> nn.Module:
        """RTN methods given GGUF blocks quantize their float values (a round trip); a
        QuantizedWeight (a pre-quantized checkpoint) is built as it is."""
        if isinstance(blocks, QuantizedWeight):
            if blocks.type_name not in self.accepted_formats():
                raise ValueError(f"quantization {self.name!r} cannot use {blocks.type_name} "
                                 f"weights (it takes {self.accepted_formats()})")
            return self.build(blocks, bias)
        return self.from_float(blocks.dequantize().to(dtype), bias)

    # -- saveable methods: codes first, layer second -----------------------------------------

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight | torch.Tensor:
        """Float weight [out, in] -> its codes (a float tensor: the layer stays float)."""
        raise NotImplementedError(f"quantization {self.name!r} cannot be saved as a "
                                  "checkpoint")

    def quantize_blocks(self, blocks: GGUFBlocks, dtype: torch.dtype = torch.float32
                        ) -> QuantizedWeight | torch.Tensor:
        """What `from_blocks` builds its layer from."""
        return self.quantize(blocks.dequantize().to(dtype))

    def build(self, weight: QuantizedWeight | torch.Tensor,
              bias: torch.Tensor | None) -> nn.Module:
        raise NotImplementedError(f"quantization {self.name!r} has no build step")

    def accepted_formats(self) -> tuple[str, ...]:
        """QuantizedWeight.type_name values `build` takes."""
        return ()

    def by_rows(self, make) -> nn.Module:
        """The layer `make(activations)` builds ("float" or "int8") for this method's
        activations. Under "auto" (servelm/quant/int8_act.py): both side by side, a
        MixedLinear taking steps of fewer rows than `a8_min_rows()` with float activations
        and larger ones with int8 (an Int8Linear's int8 form on the same codes: `int8_twin`;
        other layers' codes are held in each kernel's layout); or the one form this CPU runs
        at every step."""
        if self.activations != "auto":
            return make(self.activations)
        from servelm.quant.int8_act import a8_min_rows
        from servelm.quant.mixed_linear import MixedLinear

        rows = a8_min_rows()
        if rows is None:
            return make("float")
        if rows <= 1:  # int8 at every step (a layer without int8 activations keeps float)
            return make("int8")
        small = make("float")
        twin = getattr(small, "int8_twin", None)
        full = twin() if twin is not None else None
        if full is None:
            full = make("int8")
        if not runs_int8(full):  # no int8 form: float at every step
            return small
        return MixedLinear(full, small, rows - 1)

    def lm_head_method(self) -> QuantMethod | None:
        """How the lm_head (tied or not) is quantized; None keeps it float.

        int8 (Int8Head) for every method: the head is ~20% of a small model's weights (28M of
        SmolLM2's 135M), so it must shrink for a decode step to read few bytes, but int4 there
        costs more quality than in the blocks (an error in a logit is an error in the answer).
        """
        return Int8HeadMethod("int8-head", self.compute_dtype, activations=self.activations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.compute_dtype}, {self.activations})"


class Int8Method(QuantMethod):
    """int8, one scale per row (group_size 0) or per group_size inputs (float32 scales)."""

    layer_class = Int8Linear

    def __init__(self, name: str, compute_dtype: torch.dtype = torch.bfloat16,
                 group_size: int = 0, activations: str = "float"):
        super().__init__(name, compute_dtype, activations)
        self.group_size = group_size

    def quantize(self, weight):
        if self.group_size:
            q, scale = quantize_int8_groups(weight, self.group_size)
        else:
            q, scale = quantize_int8_per_channel(weight, self.compute_dtype)
        return QuantizedWeight("int8", q.to(weight.device), scale.to(weight.device), None,
                               self.group_size)

    def build(self, weight, bias):
        return self.by_rows(lambda acts: self.layer_class(
            weight.q, weight.scale, bias, self.compute_dtype, group_size=weight.group_size,
            activations=acts))

    def accepted_formats(self):
        return (f"int8-g{self.group_size}",) if self.group_size else ("int8",)


class Int8HeadMethod(Int8Method):
    """int8 with near-max logits recomputed in float32 (see int8_head.py)."""

    layer_class = Int8Head

    def lm_head_method(self):
        return self


class Int4Method(QuantMethod):
    def __init__(self, name: str, group_size: int = 128,
                 compute_dtype: torch.dtype = torch.bfloat16, activations: str = "float"):
        super().__init__(name, compute_dtype, activations)
        self.group_size = group_size

    def quantize(self, weight):
        q, scale, zero = quantize_int4_groups(weight, self.group_size, self.compute_dtype)
        # Already rounded to the compute dtype; stored in it (exactly), as the layer keeps it.
        return QuantizedWeight("int4", q, scale.to(self.compute_dtype),
                               zero.to(self.compute_dtype), self.group_size)

    def build(self, weight, bias):
        return self.by_rows(lambda acts: Int4Linear(
            weight.q, weight.scale, weight.zero, weight.group_size, bias, self.compute_dtype,
            activations=acts))

    def accepted_formats(self):
        return (f"int4-g{self.group_size}",)


class GGUFMethod(QuantMethod):
    """A GGUF file's quantized tensors served as they are stored.

    Q4_0 / Q4_1 -> Int4Linear with groups of 32: the nibbles are the kernel's codes as they
    are, (d, m) become (scale, zero = m + 8 d) in float32 (exact up to the one rounding of
    m + 8 d; servelm's CPU kernel keeps them so, aten's and Triton's paths take the compute
    dtype).
    Q8_0 -> Int8Linear with the blocks' codes and their scale per 32 weights as they are
    (servelm's CPU int8 kernel takes group scales; the aten and Triton paths requantize per
    row); Q5_0 the same with codes q - 16 (exact, a byte a weight).
    Q4_K / Q5_K / Q6_K -> KQuantLinear on the file's super-blocks as they are, where servelm's
    C++ kernels run (elsewhere, and on a GPU, their float values: an nn.Linear).
    The lm_head, tied or not, is int8 with groups of 32 too: from a tied Q8_0
    embedding's float values, RTN per 32 gives back Q8_0's codes and scales exactly, so
    `gguf` computes with exactly the file's weights.
    Other quantized types (Q5_1, Q2_K, ...) are requantized to int8 per row; F32 / F16
    stay float.
    """

    keeps_block_types = True

    def lm_head_method(self):
        return Int8HeadMethod("int8-g32-head", self.compute_dtype, group_size=32,
                              activations=self.activations)

    def from_blocks(self, blocks, bias, dtype=torch.float32):
        if isinstance(blocks, QuantizedWeight):
            return super().from_blocks(blocks, bias, dtype)
        if blocks.type_name in KQUANT_BYTES:
            return self._kquant_layer(blocks, bias, dtype)
        return self.build(self.quantize_blocks(blocks, dtype), bias)

    def _kquant_layer(self, blocks: GGUFBlocks, bias, dtype) -> nn.Module:
        from servelm.quant.kquant_linear import KQuantLinear, kquant_ops

        if blocks.data.device.type == "cpu" and kquant_ops() is not None:
            return KQuantLinear(blocks.type_name, blocks.data, blocks.shape, bias,
                                self.compute_dtype)
        return GGUFMethod.build(self, blocks.dequantize().to(blocks.data.device, dtype), bias)

    def quantize_blocks(self, blocks, dtype=torch.float32):
        if blocks.type_name in ("Q4_0", "Q4_1"):
            q, scale, zero = decode_q4(blocks)
            # float32: d is fp16, zero = m + 8 d one float32 rounding (bf16 would move
            # perplexity by 0.06%); the CPU kernel reads float32 scales as they are.
            return QuantizedWeight("int4", q, scale.float(), zero.float(), 32)
        if blocks.type_name in ("Q8_0", "Q5_0"):
            q, d = (decode_q8_0 if blocks.type_name == "Q8_0" else decode_q5_0)(blocks)
            return QuantizedWeight("int8", q, d, None, 32)
        return Int8Method("int8", self.compute_dtype, activations=self.activations).quantize(
            blocks.dequantize())

    def quantize(self, weight):
        return weight  # not GGUF blocks: stays float

    def build(self, weight, bias):
        if isinstance(weight, QuantizedWeight):
            if weight.format == "int8":
                return Int8Method("int8", self.compute_dtype, weight.group_size,
                                  self.activations).build(weight, bias)
            return self.by_rows(lambda acts: Int4Linear(
                weight.q, weight.scale, weight.zero, 32, bias, self.compute_dtype,
                activations=acts))
        return float_linear(weight, bias)

    def accepted_formats(self):
        return ("int8", "int8-g32", "int4-g32")


class GGUFMixedMethod(GGUFMethod):
    """`gguf-mixed`: each Q4_0/Q4_1/Q8_0 matrix as a MixedLinear (servelm/quant/
    mixed_linear.py): the file's codes, as `gguf` builds them, for steps of at most a few
    rows, and their values in the model's dtype for larger steps. Other types stay float, and
    so does the lm_head (a tied one is the embedding, as without quantization). Activations
    "auto" are float here: the large steps' form is the float one already."""

    packs_float_layers = True  # the engine build packs the float forms for oneDNN

    def __init__(self, name: str, compute_dtype: torch.dtype = torch.bfloat16,
                 activations: str = "float"):
        super().__init__(name, compute_dtype, "float" if activations == "auto" else activations)

    def lm_head_method(self):
        return None

    def from_blocks(self, blocks, bias, dtype=torch.float32):
        from servelm.quant.mixed_linear import MixedLinear

        small = super().from_blocks(blocks, bias, dtype)
        if type(small) is nn.Linear or not isinstance(blocks, GGUFBlocks):
            return small  # stays float, or a pre-quantized checkpoint's codes alone
        full = nn.Linear(blocks.shape[1], blocks.shape[0], bias=bias is not None,
                         device=blocks.data.device, dtype=dtype)
        full.requires_grad_(False)
        full.weight.copy_(blocks.dequantize())
        if bias is not None:
            full.bias.copy_(bias)
        return MixedLinear(full, small)

