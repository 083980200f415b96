"""Int8Linear: weight-only int8 with one scale per output channel (symmetric, RTN).

CPU fast path: `aten._weight_int8pack_mm(x, q[out, in] int8, scales[out])`, reading one byte
per weight. It is fast only with bfloat16 activations (with float32 ones it is ~10x slower
than fp32 BLAS on this torch build, see docs/quantization.md), so by default the layer casts
x to bf16 for the op and the result back; scales are stored in bf16, rounded up so no code
leaves [-127, 127]. `compute_dtype=torch.float32` keeps the exact (slow) path for tests.
On a CUDA device the layer runs the Triton w8a16 GEMM (servelm/kernels/w8a16_gemm.py) on the
same codes, x in its own dtype; the codes need no other layout, so a layer built on the CPU
and moved to the GPU takes that path too.
"""

from __future__ import annotations

import torch

from servelm.quant.quantized_linear import QuantizedLinear, round_up_to


def quantize_int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight[out, in] float -> (q[out, in] int8 in [-127, 127], scale[out] in scale_dtype).

    Round to nearest: |w - q * scale| <= scale / 2 ~= max|w_row| / 254.
    """
    w = weight.detach().float()
    scale = round_up_to(w.abs().amax(dim=1).clamp_min(1e-12) / 127.0, scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(QuantizedLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype = torch.bfloat16, kernel: str | None = None):
        """kernel: "cpu" (aten's int8 op), "triton" (w8a16 GEMM) or None: by x's device at
        each call (CUDA: triton)."""
        if kernel not in (None, "cpu", "triton"):
            raise ValueError(f"int8 kernel must be 'cpu', 'triton' or None, got {kernel!r}")
        out_features, in_features = q.shape
        super().__init__(in_features, out_features, bias, compute_dtype)
        self.kernel = kernel
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(compute_dtype).contiguous())  # the op's dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        q, scale = quantize_int8_per_channel(weight, compute_dtype)
        return cls(q.to(weight.device), scale.to(weight.device), bias, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton" or (self.kernel is None and x.device.type == "cuda"
                                       and self.q.device == x.device):
            from servelm.kernels.w8a16_gemm import w8a16_gemm  # imports triton

            return w8a16_gemm(x, self.q, self.scale, self.bias)
        if x.device.type != "cpu":  # codes on another device: correct, not fast
            return self._add_bias(x @ self.dequantize().to(x.device, x.dtype).t())
        xc = x.to(self.compute_dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(xc, self.q, self.scale)
        return self._add_bias(y.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def num_weight_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()
