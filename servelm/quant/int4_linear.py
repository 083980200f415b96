"""Int4Linear: weight-only int4, asymmetric, one (scale, zero) per group of input columns.

    w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],   q in 0..15,  g = k // group_size

That is tinygemm's convention, which `aten._weight_int4pack_mm_for_cpu` implements; GGUF's
Q4_1 (`q * d + m`) is the same with zero = m + 8 d, and Q4_0 (`(q - 8) * d`) has zero = 0.

CPU path (`kernel="cpu"`, the default where servelm's C++ kernels build): `int4_gemm` in
servelm/cpu_kernels/quant_gemm.cpp on codes repacked in panels of 16 rows
(servelm/quant/cpu_panels.py), float32 activations, float32 math on the exact dequantized
weight; in_features is padded to a multiple of 32 (codes 8 meeting zero-padded x).
With `activations="int8"` (`--quant-activations int8`, where the CPU runs avx512_vnni: see
servelm/quant/int8_act.py) the codes are packed for `int4_gemm_a8` instead
(servelm/cpu_kernels/quant_gemm_a8.cpp): x rounded to int8 per 32 columns, integer dot
products, the same weights as (scale, offset = zero - 8 scale) per group (`so`, in float16
for GGUF's d and m, which it holds exactly: a third fewer bytes than float32 scale / zero).
`kernel="aten"` (the fallback where the kernels do not build, or `--cpu-kernels quant=torch`):
`_convert_weight_to_int4pack_for_cpu` packs the codes once (half a byte a weight);
`_weight_int4pack_mm_for_cpu` multiplies. It is fast only with bf16 activations, so x is cast
to the compute dtype (bf16 by default) and back. The op wants group_size in {32, 64, 128, 256},
in_features divisible by it and out_features by 16: other shapes are zero-padded (SmolLM2's 576
columns with group 128 become 640; padded columns meet zero-padded activations, so they add
nothing).

CUDA path (`kernel="triton"`, chosen when the codes are on a CUDA device): the Triton w4a16
GEMM (servelm/kernels/w4a16_gemm.py) with the codes packed eight to an int32 along K
(`pack_int4_along_k`) and scale / zero stored [G, N]; activations stay in their own dtype
(bf16/fp16 on a GPU), no padding is needed. StagedLinear moves GGUF blocks and saved codes to
the model's device before building, so those layers take this path too; a CPU-built layer
moved to a GPU afterwards keeps the CPU layout and dequantizes per call (correct, slow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.kernels.int4_layout import pack_int4_along_k, unpack_int4_along_k
from servelm.quant.cpu_panels import (int4_panel_weight, narrowest_exact, pack_int4_panels,
                                      pack_int4_vnni, panel_ops, unpack_int4_panels,
                                      unpack_int4_vnni)
from servelm.quant.int8_act import use_int8
from servelm.quant.quantized_linear import QuantizedLinear

GROUP_SIZES = (32, 64, 128, 256)
KERNELS = ("cpu", "aten", "triton")
_N_ALIGN = 16


def quantize_int4_groups(weight: torch.Tensor, group_size: int,
                         scale_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTN: weight[out, in] -> (q[out, in] uint8 0..15, scale[out, G], zero[out, G]).

    Each group's [min, max] maps onto 0..15: |w - dequant| <= scale / 2 = (max - min) / 30,
    plus the rounding of scale and zero to `scale_dtype` (codes are chosen against the
    rounded values). A last group cut short by in_features uses only its real columns.
    """
    w = weight.detach().float()
    n, k = w.shape
    num_groups = -(-k // group_size)
    pad = num_groups * group_size - k
    lo = F.pad(w, (0, pad), value=float("inf")).view(n, num_groups, group_size).amin(-1)
    hi = F.pad(w, (0, pad), value=float("-inf")).view(n, num_groups, group_size).amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12).to(scale_dtype).float()
    zero = (lo + 8.0 * scale).to(scale_dtype).float()
    wg = F.pad(w, (0, pad)).view(n, num_groups, group_size)
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    q = q.view(n, -1)[:, :k].to(torch.uint8)
    return q.contiguous(), scale, zero


class Int4Linear(QuantizedLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype = torch.bfloat16, kernel: str | None = None,
                 activations: str = "float"):
        """q[out, in] codes 0..15; scale, zero [out, ceil(in / group_size)].

        kernel: "cpu" (servelm's C++ int4 GEMM, float32 activations), "aten" (aten's packed
        int4 op, bf16 activations) or "triton" (servelm/kernels/w4a16_gemm.py, the CUDA path);
        None picks by where q is: "triton" on a CUDA device, else "cpu" where servelm's
        kernels build and "aten" where they do not. Each keeps the codes in its own layout,
        so the choice is made once, here. activations: "float" or "int8" (the "cpu" kernel
        only, where the CPU runs it; else float, see servelm/quant/int8_act.py).
        """
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        if kernel is None:
            kernel = ("triton" if q.device.type == "cuda"
                      else "cpu" if panel_ops() is not None else "aten")
        if kernel not in KERNELS:
            raise ValueError(f"int4 kernel must be one of {KERNELS}, got {kernel!r}")
        out_features, in_features = q.shape
        super().__init__(in_features, out_features, bias, compute_dtype)
        self.group_size = group_size
        self.kernel = kernel
        self.activations = "float"
        num_groups = -(-in_features // group_size)
        if scale.shape != (out_features, num_groups) or zero.shape != scale.shape:
            raise ValueError(f"int4 scale/zero must be [{out_features}, {num_groups}], got "
                             f"{tuple(scale.shape)} and {tuple(zero.shape)}")
        if kernel == "triton":
            # [ceil(K/8), N] int32 codes and [G, N] scale / zero: N contiguous for the kernel.
            self.register_buffer("qweight", pack_int4_along_k(q))
            self.register_buffer("scale_t", scale.t().contiguous().to(compute_dtype))
            self.register_buffer("zero_t", zero.t().contiguous().to(compute_dtype))
            return
        if kernel == "cpu":
            panel_ops(required=True)  # loads torch.ops.servelm_cpu
            self.k_padded = -(-in_features // 32) * 32
            # Scale / zero kept as given: bf16 (what the RTN quantizers round to by default)
            # or float32 (GGUF's exact (d, m + 8 d); other dtypes widen to float32).
            sz_dtype = torch.bfloat16 if scale.dtype == torch.bfloat16 else torch.float32
            qp = F.pad(q.cpu(), (0, self.k_padded - in_features), value=8)
            if use_int8(activations, f"int4 layer {out_features} x {in_features}"):
                self.activations = "int8"
                self.register_buffer("codes", pack_int4_vnni(qp))  # int4_gemm_a8's order
                s = scale.cpu().float()
                offset = zero.cpu().float() - 8 * s  # GGUF Q4_1: m again, exactly
                self.register_buffer("so", narrowest_exact(
                    pack_int4_panels(qp, s, offset, torch.float32)[1]))
                return
            codes, sz = pack_int4_panels(qp, scale.cpu().to(sz_dtype), zero.cpu().to(sz_dtype),
                                         sz_dtype)
            self.register_buffer("codes", codes)
            self.register_buffer("sz", sz)
            return
        self.k_padded = num_groups * group_size
        self.n_padded = -(-out_features // _N_ALIGN) * _N_ALIGN
        dn, dk = self.n_padded - out_features, self.k_padded - in_features
        codes = F.pad(q.to(torch.int32).cpu(), (0, dk, 0, dn), value=8)  # padded rows: 0
        # innerKTiles is ignored by the CPU packer; 2 is what torchao passes.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.stack([F.pad(scale.float(), (0, 0, 0, dn)), F.pad(zero.float(), (0, 0, 0, dn))],
                         dim=-1)  # [N', G, 2]
        self.register_buffer("packed", packed.to(q.device))
        # The op wants [G, N', 2] in the activation dtype.
        self.register_buffer("scale_zero",
                             sz.transpose(0, 1).contiguous().to(compute_dtype).to(q.device))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = 128, compute_dtype: torch.dtype = torch.bfloat16
                   ) -> Int4Linear:
        q, scale, zero = quantize_int4_groups(weight, group_size, compute_dtype)
        return cls(q, scale.to(compute_dtype), zero.to(compute_dtype), group_size, bias,
                   compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            from servelm.kernels.w4a16_gemm import w4a16_gemm  # imports triton

            return w4a16_gemm(x, self.qweight, self.scale_t, self.zero_t, self.group_size,
                              self.bias)
        if x.device.type != "cpu":  # CPU-layout codes moved to a GPU: correct, not fast
            return self._add_bias(x @ self.dequantize().to(x.device, x.dtype).t())
        if self.kernel == "cpu" and self.activations == "int8":  # pads x itself; y in x's dtype
            xa = x if x.dtype == torch.bfloat16 else x.float()
            y = torch.ops.servelm_cpu.int4_gemm_a8(xa.contiguous(), self.codes, self.so,
                                                   self.out_features, self.group_size)
            return self._add_bias(y).to(x.dtype)
        if self.kernel == "cpu":
            xf = x.float()
            if self.k_padded != self.in_features:
                xf = F.pad(xf, (0, self.k_padded - self.in_features))
            y = torch.ops.servelm_cpu.int4_gemm(xf.contiguous(), self.codes, self.sz,
                                                self.out_features, self.group_size)
            return self._add_bias(y).to(x.dtype)
        xc = x.to(self.compute_dtype)
        if self.k_padded != self.in_features:
            xc = F.pad(xc, (0, self.k_padded - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc.contiguous(), self.packed,
                                                      self.group_size, self.scale_zero)
        if self.n_padded != self.out_features:
            y = y[:, : self.out_features]
        return self._add_bias(y.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        if self.kernel == "triton":
            k, g = self.in_features, self.group_size
            q = unpack_int4_along_k(self.qweight, k).float()
            scale = self.scale_t.float().t().repeat_interleave(g, dim=1)[:, :k]
            zero = self.zero_t.float().t().repeat_interleave(g, dim=1)[:, :k]
            return ((q - 8) * scale + zero).cpu()
        if self.kernel == "cpu":
            if self.activations == "int8":
                w = int4_panel_weight(unpack_int4_vnni(self.codes.cpu(), self.out_features),
                                      self.so.cpu(), self.out_features, self.group_size,
                                      centred=False)
            else:
                w = unpack_int4_panels(self.codes.cpu(), self.sz.cpu(), self.out_features,
                                       self.group_size)
            return w[:, : self.in_features].contiguous()
        # The packed layout is the kernel's business: read the weight back through it in
        # float32, with an identity as x (exact: one product and one sum per entry).
        eye = torch.eye(self.k_padded)
        wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed.cpu(), self.group_size,
                                                       self.scale_zero.cpu().float())
        return wt.t()[: self.out_features, : self.in_features].contiguous()

    @property
    def num_weight_bytes(self) -> int:
        if self.kernel == "triton":
            parts = (self.qweight, self.scale_t, self.zero_t)
        elif self.kernel == "cpu":
            parts = (self.codes, self.so if self.activations == "int8" else self.sz)
        else:
            parts = (self.packed, self.scale_zero)
        return sum(t.numel() * t.element_size() for t in parts)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", group_size={self.group_size}, kernel={self.kernel}"
                f", activations={self.activations}")
