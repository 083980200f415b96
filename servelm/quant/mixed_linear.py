"""MixedLinear: one weight in two forms, each for the steps it is fast at.

A decode step of a few sequences reads every weight once for a few rows of work: it is bound
by memory, and a GGUF file's 4-bit codes are a quarter of bfloat16's bytes. A step of many
rows is bound by arithmetic, where oneDNN's bfloat16 GEMM on AMX tiles or avx512_bf16 dot
products is several times servelm's quantized kernels. `gguf-mixed` (servelm/quant/methods.py)
keeps both: the file's codes (Int4Linear / Int8Linear, the file's weights exactly, float32
activations) for steps of at most `max_rows` rows, and their values in the model's dtype (an
nn.Linear, packed by layers/linear.py's pack_linears like any other) above that.

The same two-form layer holds float32 weights too (servelm/layers/linear.py,
pair_with_panels): oneDNN's packed GEMM for prefill chunks, servelm's panel GEMM (DetLinear's
kernel, one pass over the weights) for decode steps of up to 16 rows on AVX-512 or 64 on AVX2.

And one weight's codes in their two kernels' layouts (`--quant-activations auto`, what a
GGUF K-quant file runs by default: QuantMethod.by_rows): the float-activation kernel for steps
of a few rows, the int8-activation one (integer dot products) for larger steps; the rows
where int8 takes over are measured per CPU path (servelm/quant/int8_act.py, A8_MIN_ROWS). The
codes are held in both layouts (cpu_panels.py: the float kernel's panels, the dot products'
VNNI order).

Where one form overtakes the other is measured by benchmarks/cpu/mixed_crossover.py (the
default model's 30 layers of linears with their weights in DRAM; docs/benchmarks.md has the
record): MAX_ROWS is read off that curve.

The two forms round differently (the codes' exact values against their bfloat16 roundings),
so a sequence's logits depend on how many rows its step had, as bfloat16 GEMMs' do on the
batch's shape already; --deterministic never takes this path.

Owns: choosing a form by rows. Never: quantizes (the file's codes are used as stored).
"""

from __future__ import annotations

import torch
from torch import nn

MAX_ROWS = 4  # rows a step may have for the codes (where they still beat bfloat16)


class MixedLinear(nn.Module):
    def __init__(self, full: nn.Module, small: nn.Module, max_rows: int = MAX_ROWS):
        super().__init__()
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.full, self.small, self.max_rows = full, small, max_rows
        self.in_features, self.out_features = small.in_features, small.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.small.bias

    def form(self, x: torch.Tensor) -> nn.Module:
        """The form a step of x's rows takes."""
        rows = x.numel() // max(1, x.shape[-1])
        return self.small if rows <= self.max_rows else self.full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form(x)(x)

    def extra_repr(self) -> str:
        return f"max_rows={self.max_rows}"
