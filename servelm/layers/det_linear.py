"""DetLinear: the batch-invariant float32 linear of deterministic mode (CPU), and the swap of
a model's linears for batch-invariant ones (`make_deterministic`).

oneDNN's and MKL's GEMMs choose their blocking and K split by the number of rows, so a
token's output row changes in the last bits with the batch it lands in (a prefill chunk of
M tokens, a decode batch of B sequences). DetLinear's kernel (cpu_kernels/det_gemm.cpp)
sums every output element in one fixed order, so a row's result is the same bits at any M,
at any place in the batch and at any thread count. It costs about what oneDNN's packed
GEMM does: measured on the model's shapes it was faster below ~16 rows and up to ~1.3x
slower at hundreds on an AVX-512 Xeon; on an AVX2-only EPYC 1.1-2x faster up to 64 rows and
0.8-1.0x at 256 (docs/benchmarks.md, "Deterministic mode").

A bfloat16 model needs no kernel of its own: servelm's bfloat16 GEMMs already sum each output
element in one order at any row count (tests/determinism/test_bf16_kernels.py). DotLinear
(dot_gemm.cpp) runs one chain of vdpbf16ps over the pairs of K from zero for every element,
the threads and row blocks only deciding which elements are computed together; AmxLinear
(amx_gemm.cpp) adds the K tiles in order into each 16 x 16 block, and a tile's rows are
independent (a row past M is a zero row, a K past the weight's a zero pair). What is not
invariant is the default's switch to oneDNN for steps of more than 64 rows on an AMX CPU
(layers/linear.py, pair_with_tiles): here every row count takes the same kernel. The head is
a DotLinear returning its float32 sums wherever avx512_bf16 runs, as the default's is on a
CPU without AMX, so logits have no bfloat16 ties to break.

On the GPU (the Triton backend) the same swap takes TritonDetLinear instead: the fixed-tile
Triton matmul of servelm/kernels/batch_invariant.py in the model's dtype (float32, bfloat16
or float16 with float32 accumulation), and every RMSNorm runs that module's per-row kernel.

Owns: packing a float weight once into the kernel's panels, the choice of batch-invariant CPU
linear by dtype (`cpu_linear_kind`), and `make_deterministic(model)`, which swaps every float
linear of a model (nn.Linear, PackedLinear, a tied head) for one.
Never: runs a CPU kernel on another device or dtype than its own (float32: DetLinear;
bfloat16: DotLinear / AmxLinear; float16 is refused), or the Triton one off the Triton backend.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm import cpu_kernels


class DetLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        ops = cpu_kernels.load()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", ops.det_pack(weight.detach().float()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.servelm_cpu.det_linear(x, self.packed_weight, self.bias,
                                                self.out_features)

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py)."""
        from servelm.quant.decode_entry import KIND_DET, plain_entry

        return plain_entry(KIND_DET, self, self.packed_weight, self.bias)


class TritonDetLinear(nn.Module):
    """The GPU's batch-invariant linear: y = x @ W.T + b through bi_matmul (fixed tiles, no
    split of K), whatever the number of rows.

    Under the Triton interpreter (TRITON_INTERPRET=1, the CPU tests) tl.dot is numpy's matmul
    of the tile, and a BLAS's GEMM sums a row's K products in an order that can depend on
    the row's place in the tile: OpenBLAS's AVX2 (Haswell) sgemm kernel gives rows 6-11 and
    18-31 of a [32, 64] @ [64, 128] product other bits than row 0 for the same data. There
    bi_matmul puts every row alone at the top of a tile of its own, so its dot is the same
    numpy call on the same operands at any batch size, on any CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from servelm.kernels.batch_invariant import bi_matmul

        self.calls += 1
        y = bi_matmul(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def _weight_of(m: nn.Module) -> torch.Tensor | None:
    """The float weight [N, K] of a linear layer servelm builds, or None if not one."""
    from servelm.layers.linear import PackedLinear

    if type(m) is nn.Linear:
        return m.weight
    if type(m) is PackedLinear:  # oneDNN's blocked copy; its plain rows come back by reorder
        return m.dense_weight()
    return None


def cpu_linear_kind(dtype: torch.dtype) -> str | None:
    """The batch-invariant CPU linear for weights of `dtype`: 'det' (float32, DetLinear),
    'amx' (bfloat16 where AMX-BF16 runs: the tiles the default decodes on, AmxLinear), 'dot'
    (bfloat16 on avx512_bf16, DotLinear), or None where there is none (float16; bfloat16 on
    a CPU without either)."""
    if dtype == torch.float32:
        return "det"
    if dtype != torch.bfloat16:
        return None
    from servelm.layers.amx_linear import amx_usable
    from servelm.layers.dot_linear import dot_usable

    if amx_usable():
        return "amx"
    return "dot" if dot_usable() else None


def _cpu_linear(weight: torch.Tensor, name: str, is_head: bool):
    """make(weight, bias) for layer `name` on the CPU; a bfloat16 head keeps float32 logits."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.dot_linear import DotLinear, dot_usable

    kind = cpu_linear_kind(weight.dtype) if weight.device.type == "cpu" else None
    if kind is None:
        raise ValueError("deterministic mode runs float32, or bfloat16 on servelm's bfloat16 "
                         f"GEMM (avx512_bf16 or AMX), on the CPU; layer {name} is "
                         f"{weight.dtype} on {weight.device}")
    if kind == "det":
        return DetLinear
    if is_head and dot_usable():
        def head(w, b):
            layer = DotLinear(w, b)
            layer.float_out()
            return layer
        return head
    return AmxLinear if kind == "amx" else DotLinear


def make_deterministic(model: nn.Module, kernel: str = "cpu") -> int:
    """Replace every float linear of `model` (and a tied output head: model.lm_head None)
    by a batch-invariant one: on the CPU (kernel 'cpu') a DetLinear for float32 weights, a
    DotLinear or AmxLinear for bfloat16 ones (cpu_linear_kind; the head a DotLinear with
    float32 outputs where avx512_bf16 runs); on the GPU (kernel 'triton') a TritonDetLinear,
    and every RMSNorm on its per-row kernel. Returns how many linears. Raises ValueError
    naming a layer it cannot take (quantized linears, MoE experts, a dtype without a
    batch-invariant kernel), so deterministic mode never silently runs an M-dependent
    kernel."""
    from servelm.layers.moe import Experts
    from servelm.layers.norm import RMSNorm

    if kernel not in ("cpu", "triton"):
        raise ValueError(f"kernel must be 'cpu' or 'triton', got {kernel!r}")

    def make_for(weight, name, is_head):
        return TritonDetLinear if kernel == "triton" else _cpu_linear(weight, name, is_head)

    for name, m in model.named_modules():
        if isinstance(m, Experts):
            raise ValueError(f"deterministic mode does not support mixture-of-experts layers "
                             f"({name}): the expert matmuls group tokens by batch")
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            weight = _weight_of(child)
            if weight is not None:
                is_head = parent is model and name == "lm_head"
                targets.append((parent, name, child, weight, make_for(weight, name, is_head)))
            elif _is_linear_like(child):
                raise ValueError(f"deterministic mode takes float linears only; {name} is a "
                                 f"{type(child).__name__} (quantized models are not covered)")
    for parent, name, child, weight, make in targets:
        setattr(parent, name, make(weight, child.bias))
    count = len(targets)
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        weight = model.embed_tokens.weight
        model.lm_head = make_for(weight, "lm_head", True)(weight, None)
        count += 1
    if kernel == "triton":
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.batch_invariant = True
    return count


def _is_linear_like(m: nn.Module) -> bool:
    from servelm.quant.quantized_linear import QuantizedLinear

    return isinstance(m, QuantizedLinear) or (isinstance(m, nn.Linear) and type(m) is not nn.Linear)


def det_linear_calls() -> int:
    """det_linear kernel calls in this process so far (tests check the kernel ran)."""
    return int(cpu_kernels.load().det_linear_calls())
