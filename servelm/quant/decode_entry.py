"""Each linear layer's form in the C++ decode stack (cpu_kernels/decode_stack.cpp).

Owns: the stack's linear kinds (the C++ `LinearKind` numbers) and `decode_entry(m)`, a
linear's tensors and integers in the order the stack reads them. A layer class of servelm's
own describes itself (`decode_entry()` on PackedLinear, DetLinear, AmxLinear, DotLinear,
and in servelm/quant KQuantLinear, RowPartsLinear and PermutedLinear); torch's nn.Linear and
the plain Int4Linear / Int8Linear are described here. A layer
without a form gets None, and the caller says so by name. It sits in quant/, below layers/,
because both describe their linears with it (quant's hold others: row parts, permuted).
Never: chooses a layer's kind (the engine build does) or reads a model's layout
(models/fast_path.py does).

    kind        tensors (a, b, bias)                 ints (kind, n, group, k)
    float       weight, -, bias in weight's dtype    n, 0, k
    int4        codes, sz, float32 bias              n, group, k padded
    int8        codes, scale32, float32 bias         n, group, k
    packed      oneDNN weight, -, bias               n, 0, k
    det         panel weight, -, float32 bias        n, 0, k
    int4 a8     codes, so, bias as the layer adds    n, group, k padded
    int8 a8     codes, scale32, bias as the layer    n, group, k
    amx / dot   tiles, -, float32 bias               n, 0, k
    kquant      codes, -, bias as the layer adds it  n, ggml type, most q8_K rows
    row parts   -, -, -                              n, number of parts, k    + each part
    permuted    perm, -, -                           n, 1, k                  + the inner

A layer holding others (row parts, permuted) is followed by their entries, in order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

KIND_FLOAT, KIND_INT4, KIND_INT8, KIND_PACKED, KIND_DET = 0, 1, 2, 3, 4
KIND_INT4_A8, KIND_INT8_A8 = 5, 6  # the same layers with int8 activations (quant_gemm_a8.cpp)
KIND_AMX = 7  # a bfloat16 AmxLinear (amx_gemm.cpp)
KIND_DOT = 8  # a bfloat16 DotLinear (dot_gemm.cpp)
KIND_KQUANT = 9  # a GGUF K-quant matrix as the file's super-blocks (kquant_gemm.cpp)
KIND_PARTS = 10  # a fused layer whose row parts are layers of their own
KIND_PERMUTED = 11  # an int4 / int8 layer on its inputs gathered into its codes' order
# kinds whose kernels take bfloat16 rows (the others take float32 rows)
BF16_ROW_KINDS = frozenset({KIND_FLOAT, KIND_PACKED, KIND_DOT, KIND_INT4_A8, KIND_INT8_A8,
                            KIND_KQUANT})

_NONE = torch.empty(0)


class DecodeEntry(NamedTuple):
    """One linear as the stack takes it; an absent tensor is empty. `held`: the entries of
    the layers it holds (row parts, a permuted layer's inner), which follow its own."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor
    n: int
    group: int
    k: int
    held: tuple[DecodeEntry, ...] = ()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.a, self.b, self.bias] + [t for e in self.held for t in e.tensors]

    @property
    def ints(self) -> list[int]:
        return [self.kind, self.n, self.group, self.k] + [i for e in self.held for i in e.ints]

    @property
    def kernel_kinds(self) -> set[int]:
        """The kinds whose kernels run on x: its own, or those of the layers it holds."""
        if not self.held:
            return {self.kind}
        return set().union(*(e.kernel_kinds for e in self.held))


def holding_entry(kind: int, m: nn.Module, held: list[DecodeEntry | None],
                  a: torch.Tensor = _NONE) -> DecodeEntry | None:
    """The entry of layer `m` that holds the layers of entries `held` (KIND_PARTS: its row
    parts; KIND_PERMUTED: its inner, `a` the permutation), or None where one has no form."""
    if not held or any(e is None for e in held):
        return None
    group = len(held) if kind == KIND_PARTS else 1
    return DecodeEntry(kind, a, _NONE, _NONE, m.out_features, group, m.in_features, tuple(held))


def plain_entry(kind: int, m: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> DecodeEntry:
    """A layer of one packed weight and no scales."""
    return DecodeEntry(kind, weight, _NONE, _NONE if bias is None else bias,
                       m.out_features, 0, m.in_features)


def decode_entry(m: nn.Module) -> DecodeEntry | None:
    """The stack's form of linear `m` (one form of a MixedLinear: see `forms`), or None."""
    own = getattr(m, "decode_entry", None)
    if own is not None:
        return own()
    if type(m) is nn.Linear:
        w = m.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
            return None
        # at::linear takes the bias in the weight's dtype
        return plain_entry(KIND_FLOAT, m, w.detach(),
                           None if m.bias is None else m.bias.detach().to(w.dtype).contiguous())
    return _quantized_entry(m)


def _quantized_entry(m: nn.Module) -> DecodeEntry | None:
    from servelm.quant.int4_linear import Int4Linear
    from servelm.quant.int8_linear import Int8Linear

    if type(m) not in (Int4Linear, Int8Linear) or m.kernel != "cpu":
        return None
    a8 = m.activations == "int8"
    if a8:  # y in x's dtype: the bias as the layer adds it
        bias = _NONE if m.bias is None else m.bias
    else:
        bias = _NONE if m.bias is None else m.bias.detach().float().contiguous()
    if type(m) is Int4Linear:
        return DecodeEntry(KIND_INT4_A8 if a8 else KIND_INT4, m.codes, m.so if a8 else m.sz,
                           bias, m.out_features, m.group_size, m.k_padded)
    return DecodeEntry(KIND_INT8_A8 if a8 else KIND_INT8, m.codes, m.scale32, bias,
                       m.out_features, m.group_size, m.in_features)


def is_mixed(m: nn.Module) -> bool:
    from servelm.quant.mixed_linear import MixedLinear

    return type(m) is MixedLinear


def forms(m: nn.Module) -> dict[str, nn.Module]:
    """A MixedLinear's forms for steps of many rows ("full") and few ("small"); any other
    layer is its own form of both."""
    if is_mixed(m):
        return {"full": m.full, "small": m.small}
    return {"full": m, "small": m}
