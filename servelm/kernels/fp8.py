"""fp8 (e4m3) helpers for the Triton kernels: rounding onto the e4m3 grid in float32.

Why not just `x.to(tl.float8e4nv)`: under TRITON_INTERPRET=1, Triton 3.9's float32 -> e4m3
conversion is wrong when rounding carries into the exponent (1.96 -> 1.0, 7.93 -> 4.0:
measured, up to 8 codes off) and rounds ties away from zero. The kernels therefore round in
float32 first, with one add and one subtract of a power of two (round-to-nearest-even by the
float32 adder itself), and cast a value that is already on the grid, which every converter
gets right. On a GPU this costs two adds per element in a memory-bound kernel, and the code
the interpreter tests is the code the GPU runs.

Owns the grid rounding and the saturation bound; the torch twin is servelm.kernels.fp8_format.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def saturate_round_e4m3(x):
    """float32 x -> float32 on the e4m3 grid: clamp to [-448, 448], round to nearest even.

    For |x| in [2^e, 2^(e+1)) e4m3 keeps 3 mantissa bits, a spacing of 2^(e-3); adding
    C = 2^(e+20) moves |x| into a binade whose float32 spacing is exactly that, so the adder
    rounds |x| to the e4m3 grid; subtracting C is exact. Below 2^-6 (subnormals) the spacing
    stays 2^-9, so e is held at -6 there.
    """
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    biased_exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    magic = ((biased_exp + 20) << 23).to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    r = (ax + magic) - magic
    return tl.where(bits < 0, -r, r)  # keeps the sign of -0.0, as torch's cast does
