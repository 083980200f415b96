"""PackedLinear: a float linear layer whose weight oneDNN reorders once for the CPU's GEMM.

MKL's sgemm repacks the weight on every call; packing it once at load time measured 1.3-2x
faster per call on the CI machine (64 x 576 @ 576 x 3072: 1.48 -> 1.02 ms; the 49,152-row
lm_head: 36.6 -> 18.3 ms at 64 tokens, 9.7 -> 4.3 ms at one token). A bfloat16 weight is
packed for oneDNN's bfloat16 GEMM, which runs on AMX tiles or avx512_bf16 dot products where
the CPU has them (3-4x float32 at 64 tokens on an AMX Xeon, docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN takes this weight: float32 on any CPU; bfloat16 only where oneDNN has a
    bfloat16 GEMM for this CPU (it refuses the reorder on one without AVX-512 or AVX-NE-CONVERT,
    and there aten's own bfloat16 matmul runs instead)."""
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [], "")

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py): the bias as passed."""
        from servelm.quant.decode_entry import KIND_PACKED, plain_entry

        return plain_entry(KIND_PACKED, self, self.packed_weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The plain weight [N, K] back from oneDNN's blocked copy (deterministic mode
        repacks it for its own kernel): the identity's rows through the layer. Exact: each
        output is one product 1 * w plus products with 0."""
        eye = torch.eye(self.in_features, dtype=self.packed_weight.dtype)
        out = torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], "")
        return out.t().contiguous()


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a loaded float model by a PackedLinear; a tied output head
    (model.lm_head None) gets a packed copy of the embedding. Returns how many were packed."""
    return _replace_float_linears(model, PackedLinear)


def _replace_float_linears(model: nn.Module, make) -> int:
    """Every nn.Linear becomes make(weight, bias), a tied head (model.lm_head None)
    make(the embedding's weight, None). Returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, make(child.weight, child.bias))
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        model.lm_head = make(model.embed_tokens.weight, None)
        return len(targets) + 1
    return len(targets)


# Rows up to which servelm's panel GEMM (cpu_kernels/det_gemm.cpp) beats oneDNN's packed
# float32 GEMM on the model's shapes, by the widest vector set the machine runs: measured by
# benchmarks/cpu/linear_rates_micro.py (docs/benchmarks.md, "Deterministic mode"): on an
# AVX2-only EPYC 1.1-2x up to 64 rows, 0.8-1.0x at 256; on an AVX-512 Xeon faster below
# about 16 rows, up to 1.3x slower at hundreds.
PANEL_ROWS = {"avx512f": 16, "avx2": 64}


def panel_rows() -> int:
    """Rows a step may have for the panel form of float32 linears on this CPU (0: none)."""
    from servelm.cpu_kernels import isa

    for name, rows in PANEL_ROWS.items():
        if isa.usable(name):
            return rows
    return 0


def pair_with_panels(model: nn.Module, max_rows: int) -> int:
    """pack_linears, and each packed layer (a tied head's copy too) also gets a second form on
    servelm's panel GEMM (DetLinear's kernel) for steps of at most `max_rows` rows: it
    becomes a MixedLinear(full=the PackedLinear, small=a DetLinear of the same weight). A
    decode step of a few sequences is bound by reading the weights, where the panels' single
    pass beats oneDNN's blocking for few rows; prefill chunks keep oneDNN. Costs a second
    copy of the float weights. Returns how many linears were paired.

    The two forms sum in different orders, so a row's logits move in the last bits with its
    step's row count (as they do with oneDNN alone across its own M-dependent blockings);
    --deterministic never takes this path (every linear is a DetLinear there)."""
    from servelm.layers.det_linear import DetLinear
    from servelm.quant.mixed_linear import MixedLinear

    def pair(weight, bias):
        return MixedLinear(PackedLinear(weight, bias), DetLinear(weight, bias), max_rows)

    return _replace_float_linears(model, pair) + pack_float_experts(model, DetLinear)


# Rows up to which servelm's AMX tile GEMM (cpu_kernels/amx_gemm.cpp) beats oneDNN's packed
# bfloat16 GEMM on the model's shapes: benchmarks/cpu/amx_linear_micro.py, record
# amx-linear-micro-20261204T200424Z (docs/benchmarks.md), an AMX Xeon, weights in memory:
# 0.79-0.85x oneDNN's time at 1-16 rows, 0.88x at 64, 1.08x at 256, 1.9x at 2048.
AMX_ROWS = 64


def pair_with_tiles(model: nn.Module, max_rows: int = AMX_ROWS) -> int:
    """pack_linears for a bfloat16 model, and each packed layer (a tied head's copy too) also
    gets the AMX tiles' form (AmxLinear) for steps of at most `max_rows` rows: a
    MixedLinear(full=the PackedLinear, small=the AmxLinear). Costs a second copy of the
    weights. Returns how many linears were paired. Both forms sum float32 products of the
    same bfloat16 values, in different orders, then round once."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.quant.mixed_linear import MixedLinear

    def pair(weight, bias):
        return MixedLinear(PackedLinear(weight, bias), AmxLinear(weight, bias), max_rows)

    return _replace_float_linears(model, pair)


def pack_dot_linears(model: nn.Module) -> int:
    """Every float linear of a bfloat16 model (a tied head's copy too) becomes a DotLinear:
    servelm's avx512_bf16 GEMM at every row count, in place of oneDNN's (one copy of the
    weights). The output head keeps its float32 sums as the logits (DotLinear.float_out).
    Returns how many."""
    from servelm.layers.dot_linear import DotLinear

    num = _replace_float_linears(model, DotLinear) + pack_float_experts(model, DotLinear)
    for module in model.modules():
        head = getattr(module, "lm_head", None)
        if type(head) is DotLinear:
            head.float_out()
    return num


def pack_float_experts(model: nn.Module, make) -> int:
    """Every float mixture of experts (layers/moe.py's Experts, on one rank) takes each
    expert's matrices as make(weight, None) layers: float32 DetLinear, whose panel GEMM is
    the same sums at any row count, so an expert's few routed rows give the same bits in a
    decode step of any size, eager or in the C++ stack (a MixedLinear would pick its form
    by the expert's rows eagerly but by the step's in the stack); bfloat16 DotLinear.
    Returns how many layers."""
    from servelm.layers.moe import Experts

    return sum(m.pack_experts(make) for m in model.modules()
               if type(m) is Experts and m.w13 is not None and m.w13.device.type == "cpu")


def float_weight_bytes(model: nn.Module) -> int:
    """Bytes of the float linears' weights pack_linears would pack (a tied head counted)."""
    n = sum(m.weight.numel() * m.weight.element_size()
            for m in model.modules() if type(m) is nn.Linear)
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        w = model.embed_tokens.weight
        n += w.numel() * w.element_size()
    return n
