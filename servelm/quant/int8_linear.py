"""Int8Linear: weight-only int8 with one scale per output channel (symmetric, RTN).

CPU path (`kernel="cpu"`, the default where servelm's C++ kernels build): `int8_gemm` in
servelm/cpu_kernels/quant_gemm.cpp on the codes repacked in panels of 16 rows
(servelm/quant/cpu_panels.py), float32 activations and math. `kernel="aten"` (the fallback
where they do not build, or `--cpu-kernels quant=torch`): `aten._weight_int8pack_mm(x, q[out, in]
int8, scales[out])`, fast only with bfloat16 activations (with float32 ones it is ~10x slower
than fp32 BLAS on this torch build, see docs/quantization.md), so the layer casts x to the
compute dtype (bf16 by default) for the op and the result back. Scales are stored in the
compute dtype, rounded up so no code leaves [-127, 127].

With `activations="int8"` (`--quant-activations int8`, where the CPU runs avx512_vnni: see
servelm/quant/int8_act.py) the "cpu" kernel is `int8_gemm_a8` (servelm/cpu_kernels/
quant_gemm_a8.cpp) on the codes + 128 in its VNNI order: x rounded to int8 per 32 columns,
integer dot products, the same scales (per row, or per group of a multiple of 32 columns),
stored in the narrowest float type that holds them exactly (`scale32` is then float16 for
Q8_0's d, bfloat16 for the per-row method's scales).

`int8_twin()` is the same layer with int8 activations holding the same tensors: the
int8-activation kernel takes the float kernel's panels too, turning each panel into its own
order as it goes (a cost a step of many rows shares), so `--quant-activations auto`
(servelm/quant/int8_act.py) keeps the codes once for both forms.

Grouped int8 (`group_size` > 0: one float32 scale per `group_size` inputs of a row, GGUF's
Q8_0 with group 32) runs as it is on the "cpu" kernel only; the aten and Triton paths take one
scale per row, so there the weight is requantized per row at construction.
On a CUDA device the layer runs the Triton w8a16 GEMM (servelm/kernels/w8a16_gemm.py) on the
same codes, x in its own dtype; the codes need no other layout, so a layer built on the CPU
and moved to the GPU takes that path too.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

from servelm.quant.cpu_panels import (narrowest_exact, pack_int8_panels, pack_int8_vnni,
                                      panel_ops, unpack_int8_panels, unpack_int8_vnni)
from servelm.quant.int8_act import use_int8
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


def quantize_int8_groups(weight: torch.Tensor, group_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight[out, in] -> (q[out, in] int8 in [-127, 127], scale[out, G] float32): RTN with
    scale = max|w| / 127 per group, as ggml's Q8_0 (whose dequantized values this gives back
    exactly: each block's largest weight is 127 d)."""
    w = weight.detach().float()
    n, k = w.shape
    num_groups = -(-k // group_size)
    wg = F.pad(w, (0, num_groups * group_size - k)).view(n, num_groups, group_size)
    scale = wg.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / safe[..., None]).clamp_(-127, 127).view(n, -1)[:, :k]
    return q.to(torch.int8).contiguous(), scale


class Int8Linear(QuantizedLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype = torch.bfloat16, kernel: str | None = None,
                 group_size: int = 0, activations: str = "float"):
        """kernel: "cpu" (servelm's C++ int8 GEMM on panels, float32 activations), "aten"
        (aten's int8 op, bf16 activations), "triton" (w8a16 GEMM) or None: codes on the CPU
        take "cpu" where servelm's kernels build; otherwise by x's device at each call
        (CUDA: triton, CPU: aten). group_size 0: scale [out]; else scale [out, G] float32.
        activations: "float" or "int8" ("cpu" kernel, group_size 0 or a multiple of 32, where
        the CPU runs it; else float, see servelm/quant/int8_act.py)."""
        if kernel not in (None, "cpu", "aten", "triton"):
            raise ValueError("int8 kernel must be 'cpu', 'aten', 'triton' or None, got "
                             f"{kernel!r}")
        if kernel is None and q.device.type == "cpu" and panel_ops() is not None:
            kernel = "cpu"
        if group_size and kernel != "cpu":  # the other kernels take a scale per row
            w = q.float() * scale.float().repeat_interleave(group_size, dim=1)[:, :q.shape[1]]
            q, scale = quantize_int8_per_channel(w, compute_dtype)
            group_size = 0
        out_features, in_features = q.shape
        super().__init__(in_features, out_features, bias, compute_dtype)
        self.kernel = kernel
        self.group_size = group_size
        self.activations = "float"
        # the op's dtype; group scales (Q8_0's fp16 d) stay float32, exact
        self.register_buffer("scale", scale.to(torch.float32 if group_size else compute_dtype)
                             .contiguous())
        if kernel == "cpu":  # the panels replace q: one copy of the codes
            panel_ops(required=True)  # loads torch.ops.servelm_cpu
            codes, scale32 = pack_int8_panels(q.cpu(), self.scale.cpu())
            if group_size % 32 == 0 and use_int8(
                    activations, f"int8 layer {out_features} x {in_features}"):
                self.activations = "int8"
                codes = pack_int8_vnni(q.cpu())  # the same codes + 128, in int8_gemm_a8's order
                scale32 = narrowest_exact(scale32)  # Q8_0's d: float16, half the bytes
            self.register_buffer("codes", codes)
            self.register_buffer("scale32", scale32)
            self.register_buffer("q", None)
        else:
            self.register_buffer("q", q.to(torch.int8).contiguous())

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
        if self.kernel == "cpu" and self.activations == "int8":  # y in x's dtype
            xa = x if x.dtype == torch.bfloat16 else x.float()
            y = torch.ops.servelm_cpu.int8_gemm_a8(xa.contiguous(), self.codes, self.scale32,
                                                   self.out_features, self.group_size)
            return self._add_bias(y).to(x.dtype)
        if self.kernel == "cpu":
            y = torch.ops.servelm_cpu.int8_gemm(x.float().contiguous(), self.codes,
                                                self.scale32, self.out_features, self.group_size)
            return self._add_bias(y).to(x.dtype)
        xc = x.to(self.compute_dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(xc, self.q, self.scale)
        return self._add_bias(y.to(x.dtype))

    def int8_twin(self) -> Int8Linear | None:
        """This layer with int8 activations on the same codes and scales (shared, not
        copied), or None: a layer of another kernel or layout, groups the dot products do
        not take, a CPU without them, or kernels that cannot read the float panels."""
        if (self.kernel != "cpu" or self.activations != "float" or self.group_size % 32
                or self.codes.dtype != torch.int8 or not a8_takes_float_panels()
                or not use_int8("int8", f"int8 layer {self.out_features} x "
                                        f"{self.in_features}")):
            return None
        twin = copy.copy(self)  # then its own module dicts, holding the same tensors
        twin._parameters, twin._buffers = dict(self._parameters), dict(self._buffers)
        twin._modules = dict(self._modules)
        twin.activations = "int8"
        return twin

    def codes_int8(self) -> torch.Tensor:
        """The int8 codes [out, in], whatever the layout."""
        if self.q is not None:
            return self.q
        if self.codes.dtype == torch.uint8:  # the dot products' own order
            return unpack_int8_vnni(self.codes, self.out_features, self.in_features)
        return unpack_int8_panels(self.codes, self.out_features)

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.float().cpu()
        if self.group_size:
            scale = scale.repeat_interleave(self.group_size, dim=1)[:, :self.in_features]
            return self.codes_int8().float().cpu() * scale
        return self.codes_int8().float().cpu() * scale[:, None]

    @property
    def num_weight_bytes(self) -> int:
        if self.q is None:
            return self.codes.numel() + self.scale32.numel() * self.scale32.element_size()
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@functools.lru_cache(maxsize=1)
def a8_takes_float_panels() -> bool:
    """Whether the loaded int8_gemm_a8 reads the float kernel's panels ([P, K, 16] int8), as
    servelm's kernels since they could do so; a library from before refuses them."""
    ops = panel_ops()
    if ops is None:
        return False
    x, codes = torch.ones(1, 32), torch.ones(1, 32, 16, dtype=torch.int8)
    try:
        y = ops.int8_gemm_a8(x, codes, torch.ones(16), 16, 0)
    except RuntimeError:
        return False
    return bool(torch.allclose(y, torch.full((1, 16), 32.0)))
