"""DotLinear: a bfloat16 linear layer on servelm's avx512_bf16 GEMM (cpu_kernels/dot_gemm.cpp).

The weight is laid out once, at load, as AmxLinear lays it out (servelm/layers/amx_linear.py:
blocks of 16 output columns, each pair of inputs one 64-byte row), the order VDPBF16PS takes
its second operand in; the bias is kept in float32 and added before the one rounding of each
output to bfloat16 (a head's outputs stay float32: float_out). The threads split the output
columns, each streaming its own columns of the weight once for every row of the step.

Where it runs: a CPU whose avx512_bf16 the probe saw run (servelm/cpu_kernels/isa.py) and
that has no usable AMX (there AmxLinear pairs with oneDNN instead). There it replaces oneDNN's
packed bfloat16 GEMM (PackedLinear) at every row count: measured on an AMD EPYC (Zen 5),
2 threads, the default model's shapes with the weights in cache, 1.11-1.27x oneDNN's rate at
64 rows, 1.5-2.7x at 1-8 rows, 1.02-1.05x at 2048 (record dot-linear-micro in
docs/benchmarks.md). One copy of the weights, as PackedLinear keeps.

Never: chooses for a model; the engine build does (servelm/engine_builder.py,
`--cpu-kernels gemm=...`).
"""

from __future__ import annotations

import functools

import torch

from servelm.layers.amx_linear import AmxLinear


@functools.lru_cache(maxsize=1)
def dot_usable() -> bool:
    """Whether DotLinear runs here: the kernels built with avx512_bf16 and the probe saw
    vdpbf16ps run on this machine (cpu_kernels.load() tells the kernel so)."""
    from servelm import cpu_kernels
    from servelm.cpu_kernels import isa

    try:
        ops = cpu_kernels.load()
    except Exception:  # noqa: BLE001 - no kernels, no dot path
        return False
    return bool(ops.dot_linear_built()) and isa.usable("avx512_bf16")


class DotLinear(AmxLinear):
    """AmxLinear's packed weight and bias, multiplied on avx512_bf16 dot products."""

    op = "dot_linear"

    @property
    def gated(self) -> bool:
        """Whether silu_and_mul can fuse: a [gate; up] layer of 2 I rows, I a multiple of 16."""
        return self.out_features % 32 == 0

    def float_out(self) -> None:
        """From now on the outputs are the float32 sums (+ bias), not rounded to bfloat16:
        for a head, whose bfloat16 logits tied at the maximum where their float32 values do
        not (the runner's logits.py recomputed those; it has nothing to recompute now)."""
        self.op = "dot_linear_float"

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(self(x)) for a [gate; up] layer in one pass (dot_gemm.cpp's gated
        form: the gate and up stay float32 until the product is rounded once)."""
        if not self.gated:
            from servelm.layers.activation import silu_and_mul

            return silu_and_mul(self(x))
        return self._call("dot_linear_silu", x, self.out_features // 2)
