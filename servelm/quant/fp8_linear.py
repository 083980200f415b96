"""W8A8 fp8: e4m3 weights with a scale per output channel, e4m3 activations with a scale per
token computed at run time, multiplied by `torch._scaled_mm` on a GPU with fp8 tensor cores.

    w[n, :] ~= wq[n, :] * w_scale[n]      w_scale[n] = max|w[n, :]| / 448   (at load)
    x[m, :] ~= xq[m, :] * x_scale[m]      x_scale[m] = max|x[m, :]| / 448   (every call)
    y[m, n]  = x_scale[m] * w_scale[n] * sum_k xq[m, k] wq[n, k]            (fp32 accumulate)

Both scales are amax-derived, so each row's largest value lands on 448 and every value keeps
e4m3's 3 mantissa bits (relative error <= 2^-4 per operand). A per-token activation scale
follows each token's own range (an outlier token does not flatten its neighbours), which is
why it is computed per call rather than calibrated.

Where it runs: `_scaled_mm` with row-wise scales needs fp8 tensor cores, CUDA compute
capability >= 8.9 (Ada, Hopper, Blackwell); `--quantization fp8` anywhere else (the CPU
included) is refused with an error naming the parameter. torch's CPU build also implements
`_scaled_mm`, slowly; the tests use it to check this module's call (layouts, scale shapes,
padding) against `fp8_linear_ref`, the dequantize-and-matmul reference -- that is a check of
the arithmetic, not a CPU serving path.

The lm_head stays in the model dtype (as vLLM's fp8 checkpoints keep it): a per-token scale
error lands directly in the logits.

Never: quantizes on the CPU for serving, or is saved by `servelm quantize` (fp8 codes are
cheap to recompute at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.kernels.fp8_format import FP8_DTYPE, amax_scale, dequantize_fp8, quantize_fp8
from servelm.quant.methods import QuantMethod
from servelm.quant.quantized_linear import QuantizedLinear

MIN_CAPABILITY = (8, 9)
_ALIGN = 16  # _scaled_mm wants K and N multiples of 16


def fp8_support_error(device: torch.device, capability: tuple[int, int] | None = None
                      ) -> str | None:
    """Why W8A8 fp8 cannot run on `device` (None if it can). capability: the CUDA device's
    (major, minor); looked up when not given."""
    if device.type != "cuda":
        return (f"quantization 'fp8' (W8A8 via torch._scaled_mm) needs a CUDA GPU with compute "
                f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (fp8 tensor cores: "
                f"Ada, Hopper); the device is {device.type}. On the CPU use --quantization "
                "int8, int4 or gguf")
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"quantization 'fp8' (W8A8 via torch._scaled_mm) needs CUDA compute capability "
                f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (fp8 tensor cores); this GPU has "
                f"{capability[0]}.{capability[1]}. Use --quantization int8 or int4")
    return None


def check_fp8_device(device: torch.device) -> None:
    error = fp8_support_error(torch.device(device))
    if error is not None:
        from servelm.protocol import InvalidParameterError

        raise InvalidParameterError(error, param="quantization")


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight[N, K] -> (wq[N, K] e4m3, w_scale[N] float32)."""
    scale = amax_scale(weight, dim=1)  # [N, 1]
    return quantize_fp8(weight, scale), scale[:, 0].contiguous()


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, K] -> (xq[M, K] e4m3, x_scale[M, 1] float32): the dynamic activation scales."""
    scale = amax_scale(x, dim=1)  # [M, 1]
    return quantize_fp8(x, scale), scale


def fp8_linear_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: quantize x per token as the GPU path does, dequantize both operands,
    multiply in float32 -> x's dtype."""
    xq, x_scale = quantize_fp8_per_token(x)
    y = dequantize_fp8(xq, x_scale) @ dequantize_fp8(wq, w_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_fp8(xq: torch.Tensor, x_scale: torch.Tensor, wq_t: torch.Tensor,
                  w_scale_row: torch.Tensor) -> torch.Tensor:
    """The fp8 GEMM: xq[M, K] row-major, wq_t[K, N] column-major (a transposed [N, K]),
    x_scale[M, 1], w_scale_row[1, N] float32 -> [M, N] bf16 (row-wise scaling produces
    bf16 only on most GPUs)."""
    return torch._scaled_mm(xq, wq_t, scale_a=x_scale, scale_b=w_scale_row,
                            out_dtype=torch.bfloat16)


class Fp8Linear(QuantizedLinear):
    def __init__(self, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
        """wq[N, K] e4m3; w_scale[N] float32. Stored padded to multiples of 16 (zero rows and
        columns, whose scale is 1), as _scaled_mm wants."""
        if wq.dtype != FP8_DTYPE:
            raise ValueError(f"fp8 weight must be {FP8_DTYPE}, got {wq.dtype}")
        out_features, in_features = wq.shape
        super().__init__(in_features, out_features, bias, torch.bfloat16)
        self.k_padded = -(-in_features // _ALIGN) * _ALIGN
        self.n_padded = -(-out_features // _ALIGN) * _ALIGN
        dk, dn = self.k_padded - in_features, self.n_padded - out_features
        padded = F.pad(wq.view(torch.uint8), (0, dk, 0, dn)).view(FP8_DTYPE)  # 0x00 is 0.0
        # [K', N] column-major: the transpose of a contiguous [N', K'].
        self.register_buffer("weight_t", padded.t())
        self.register_buffer("w_scale_row",
                             F.pad(w_scale.float(), (0, dn), value=1.0)[None, :].contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        wq, w_scale = quantize_fp8_per_channel(weight)
        return cls(wq, w_scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_token(x)
        if self.k_padded != self.in_features:
            xq = F.pad(xq.view(torch.uint8), (0, self.k_padded - self.in_features)).view(FP8_DTYPE)
        y = scaled_mm_fp8(xq, x_scale, self.weight_t, self.w_scale_row)
        if self.n_padded != self.out_features:
            y = y[:, : self.out_features]
        return self._add_bias(y.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        w = dequantize_fp8(self.weight_t.t(), self.w_scale_row.t())
        return w[: self.out_features, : self.in_features].cpu()

    @property
    def num_weight_bytes(self) -> int:
        return self.weight_t.numel() + self.w_scale_row.numel() * 4


class Fp8Method(QuantMethod):
    """`--quantization fp8`: Fp8Linear for every linear layer but the head (kept float)."""

    def check_device(self, device: torch.device) -> None:
        check_fp8_device(device)

    def from_float(self, weight, bias):
        check_fp8_device(weight.device)
        return Fp8Linear.from_float(weight, bias)

    def quantize(self, weight):
        from servelm.protocol import InvalidParameterError

        raise InvalidParameterError("method 'fp8' is not written by `servelm quantize`: its "
                                    "codes are recomputed at load in seconds; serve the float "
                                    "checkpoint with --quantization fp8", param="method")

    def lm_head_method(self):
        return None
