"""QuantizedLinear: the interface every weight-only quantized linear layer implements.

Owns: what a quantized layer must offer the model (`forward(x[T, in]) -> [T, out]` in x's
dtype) and the tests (`dequantize()` -> the float weight it multiplies by,
`num_weight_bytes`).

Never: knows which model or checkpoint format it came from; layers are built by a method in
the registry (`servelm.quant.get_quant_method`).
"""

from __future__ import annotations

import torch
from torch import nn


def round_up_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive float32 values stored in `dtype`, rounded up (never below the input), so a
    scale stored in bf16 still maps the row's largest weight inside the code range."""
    out = values.to(dtype)
    # bf16 keeps 8 significant bits: 1 + 2^-7 clears any rounding down.
    bumped = (values * (1 + 2**-7)).to(dtype)
    return torch.where(out.float() < values, bumped, out)


class QuantizedLinear(nn.Module):
    """y = x @ dequantize().T + bias, computed without materialising the float weight.

    compute_dtype: the activation dtype the fast op runs in (bf16 on the CPU: the only one
    for which this torch build's int8/int4 CPU kernels are fast); float32 is exact but slow.
    """

    in_features: int
    out_features: int

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        # A buffer, not a Parameter: a quantized model has no float parameters to train.
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer computes with (tests, reference paths)."""
        raise NotImplementedError

    @property
    def num_weight_bytes(self) -> int:
        """Bytes a forward pass reads for the weight (codes + scales), the bias excluded."""
        raise NotImplementedError

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bytes={self.num_weight_bytes}, "
                f"compute_dtype={self.compute_dtype}")
