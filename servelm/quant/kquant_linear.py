"""KQuantLinear: a GGUF K-quant matrix (Q4_K, Q5_K, Q6_K) kept as the file's super-blocks.

The codes are the file's bytes, unchanged: [out, in / 256 * block bytes] uint8, each row its
256-column super-blocks (layouts in servelm/cpu_kernels/kquant_gemm.cpp). A step of at most
`max_int8_rows` rows (by default every step, prefill chunks too, as llama.cpp runs these
types, where avx512_vnni runs the panels kernel; 32 rows elsewhere: `default_max_int8_rows`)
runs `kquant_gemm`: the rows rounded to int8 per 256 columns (llama.cpp's q8_K), integer dot
products with the codes, the super-blocks' scales applied once per 16 columns. A layer built
with a smaller `max_int8_rows` dequantizes the matrix for larger steps into x's dtype and
multiplies with torch's GEMM (the activations keep their precision, at several times the
time).

The C++ decode stack runs it from `decode_entry()`: `codes`, `kind` (ggml's type number: 12
Q4_K, 13 Q5_K, 14 Q6_K), `out_features` and `max_int8_rows`; the scales live inside the
codes' super-blocks (cpu_kernels/kquant_gemm.h).

Never: keeps a float copy of the weight, or runs where servelm's C++ kernels do not build (the
method builds a float layer there: servelm/quant/methods.py).
"""

from __future__ import annotations

import torch

from servelm.quant.quantized_linear import QuantizedLinear

# ggml's type number and super-block bytes (256 columns) of each K-quant kept as codes
KQUANT_TYPES = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
SUPER_BLOCK = 256
# Steps of up to this many rows take the int8-activation kernel; above, a dequantized GEMM.
# Every step, where the panels kernel runs: with it (avx512_vnni) a 576 x 1536 Q4_K matrix at
# 256 rows took 2.1 ms against bfloat16's GEMM alone 4.4 ms and float32's 13 ms, before any
# dequantization (ad hoc, one core, Zen 4; docs/quantization.md).
MAX_INT8_ROWS = 1 << 30
# Without avx512_vnni the kernel has no panels (every 4 rows decode the weights again), and a
# dequantized float32 GEMM overtakes it: ad hoc, an x86-64-v3 (AVX2) build on Zen 4, one
# thread, 576 x 1536 Q4_K, q8_K / dequantized GEMM 58 / 191 us at 1 row, 981 / 1303 at 16,
# 5439 / 4102 at 64.
NO_PANELS_MAX_INT8_ROWS = 32


def default_max_int8_rows() -> int:
    """The most rows a step rounds to q8_K on this CPU (MAX_INT8_ROWS where the panels run)."""
    from servelm.cpu_kernels import isa

    return MAX_INT8_ROWS if isa.usable("avx512_vnni") else NO_PANELS_MAX_INT8_ROWS


def kquant_ops():
    """torch.ops.servelm_cpu where the kernels build and the process allows them, else None."""
    from servelm import cpu_kernels

    ops = cpu_kernels.ops_for_mode("quant")
    return ops if ops is not None and hasattr(ops, "kquant_gemm") else None


class KQuantLinear(QuantizedLinear):
    def __init__(self, type_name: str, codes: torch.Tensor, shape: tuple[int, int],
                 bias: torch.Tensor | None, compute_dtype: torch.dtype = torch.bfloat16,
                 max_int8_rows: int | None = None):
        """type_name: "Q4_K" | "Q5_K" | "Q6_K"; codes: the rows' super-blocks as the file
        stores them, [out, in / 256 * block bytes] uint8; shape: (out, in); max_int8_rows:
        None for this CPU's (`default_max_int8_rows`)."""
        if type_name not in KQUANT_TYPES:
            raise ValueError(f"type_name {type_name!r} is not a K-quant kept as codes; "
                             f"supported: {sorted(KQUANT_TYPES)}")
        out_features, in_features = shape
        kind, block_bytes = KQUANT_TYPES[type_name]
        if in_features % SUPER_BLOCK or tuple(codes.shape) != (
                out_features, in_features // SUPER_BLOCK * block_bytes):
            raise ValueError(f"{type_name} codes {tuple(codes.shape)} do not fit shape {shape} "
                             f"({block_bytes} bytes a {SUPER_BLOCK}-column super-block)")
        if codes.dtype != torch.uint8 or codes.device.type != "cpu":
            raise ValueError("codes must be uint8 on the CPU")
        super().__init__(in_features, out_features, bias, compute_dtype)
        self.type_name, self.kind = type_name, kind
        self.max_int8_rows = (default_max_int8_rows() if max_int8_rows is None
                              else max_int8_rows)
        self.register_buffer("codes", codes.contiguous())
        if kquant_ops() is None:
            raise RuntimeError("KQuantLinear needs servelm's C++ CPU kernels (kquant_gemm)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.max_int8_rows:
            xa = x2 if x2.dtype == torch.bfloat16 else x2.float()
            y = torch.ops.servelm_cpu.kquant_gemm(xa.contiguous(), self.codes, self.kind,
                                                  self.out_features)
        else:
            dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float32
            w = torch.ops.servelm_cpu.kquant_dequant(self.codes, self.kind, self.out_features,
                                                     dtype)
            y = x2.to(dtype) @ w.t()
        return self._add_bias(y).to(x.dtype).reshape(*lead, self.out_features)

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py): the codes, its ggml type
        and the most rows it rounds to q8_K; the bias as forward adds it."""
        from servelm.quant.decode_entry import KIND_KQUANT, DecodeEntry

        none = torch.empty(0)
        bias = none if self.bias is None else self.bias.detach()
        return DecodeEntry(KIND_KQUANT, self.codes, none, bias, self.out_features, self.kind,
                           self.max_int8_rows)

    def dequantize(self) -> torch.Tensor:
        return torch.ops.servelm_cpu.kquant_dequant(self.codes, self.kind, self.out_features,
                                                    torch.float32)

    @property
    def num_weight_bytes(self) -> int:
        return self.codes.numel()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", type={self.type_name}"
