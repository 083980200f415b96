"""fp8 (OCP e4m3, torch.float8_e4m3fn) quantize/dequantize: the one definition of the format's
arithmetic that the fp8 KV cache and the W8A8 linear layers share.

    code = saturate(x / scale) rounded to e4m3 (round to nearest even)      |code| <= 448
    x   ~= code * scale

e4m3 is a float format: 3 mantissa bits give a relative error of at most 2^-4 anywhere in
the normal range [2^-6, 448], whatever the scale; the scale only decides where that range
sits (values above 448 * scale saturate, values below 2^-6 * scale lose precision as
subnormals, spacing 2^-9 * scale). Saturation is explicit: torch's float -> fp8 cast does
not promise what happens out of range (e4m3fn has no inf), and a NaN in a KV block would
poison every query that reads it.

Never: imports triton, or knows whether a tensor is a weight, an activation or a KV entry.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale a dynamic (amax-derived) scale may take: an all-zero row must not
# divide by zero, and 1e-12 / 448 is still a normal float32.
MIN_SCALE = 1e-12


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to [-448, 448], rounded to e4m3. `scale` broadcasts against x."""
    y = x.float() / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale in float32, returned in `dtype`."""
    return (q.float() * scale).to(dtype)


def amax_scale(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The scale that maps max|x| (over `dim`, kept; over everything if None) onto 448."""
    amax = x.detach().abs().amax() if dim is None else x.detach().abs().amax(dim, keepdim=True)
    return (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)
