"""Quantization, registered by name: weight-only `int8`, `int4[-gN]`, `gguf`; W8A8 `fp8`.

Owns: the registry of methods, and the two calls the model code makes -- `make_linear` (a
float `nn.Linear`, or a `StagedLinear` that holds the weights while they are loaded) and
`finalize_linears` (swap each StagedLinear for the QuantizedLinear its method builds, once
fused weights are whole).

Never: imports torch at import time (the CLI lists the names), or knows a model's
layout: the model decides which layers are linear and which one is the lm_head.

    int8         per-output-channel int8, symmetric RTN            ~1.0 byte / weight
    int4[-gN]    int4 asymmetric, groups of N=32 (default)/64/128/256   ~0.5 + 4/N bytes
    gguf         a GGUF file's Q4_0/Q4_1 blocks as int4-g32 as they are, Q8_0 as int8
                 (see servelm/quant/methods.py); other types stay float
    gguf-mixed   both: gguf's codes for steps of at most 4 rows (memory-bound), the
                 dequantized weights in the model's dtype above (servelm/quant/mixed_linear.py)
    gptq, awq, compressed-tensors   such a checkpoint's codes as they are stored (int4 /
                 int8 layers; servelm/loader/community_checkpoint.py), never a float model's
    fp8          W8A8: e4m3 weights (scale per channel) and activations (scale per token)
                 via torch._scaled_mm, GPU only (CUDA >= 8.9; refused elsewhere)  ~1 byte

Every weight-only method's CPU layers compute with float32 activations, or with int8 ones
(`activations="int8"`, `--quant-activations int8`: servelm/quant/int8_act.py) where the CPU
runs avx512_vnni's integer dot products, or each step by its rows (`auto`: float for a few
rows, int8 for many; what a GGUF K-quant file runs by default).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelm.quant.methods import QuantMethod

# name -> (factory "module:callable", keyword arguments); the names are also
# servelm/config/quant_choices.py's QUANT_METHOD_NAMES, in the same order (EngineArgs checks
# --quantization there, below this package)
_METHODS: dict[str, tuple[str, dict]] = {
    "int8": ("servelm.quant.methods:Int8Method", {}),
    # Groups of 32 by default: coarser groups cost the default model (itself Q4_1) a lot of
    # perplexity (int4-g128: 25.9 -> 47.8 on servelm/evals/data/heldout_en.txt).
    "int4": ("servelm.quant.methods:Int4Method", {"group_size": 32}),
    **{f"int4-g{g}": ("servelm.quant.methods:Int4Method", {"group_size": g})
       for g in (32, 64, 128, 256)},
    "gguf": ("servelm.quant.methods:GGUFMethod", {}),
    # the file's codes for steps of a few rows, their dequantized values above (bf16 GEMMs)
    "gguf-mixed": ("servelm.quant.methods:GGUFMixedMethod", {}),
    # W8A8: e4m3 weights and per-token activations through torch._scaled_mm; CUDA sm89+ only.
    "fp8": ("servelm.quant.fp8_linear:Fp8Method", {}),
    # a GPTQ / AWQ / compressed-tensors checkpoint's own codes
    # (servelm/loader/community_checkpoint.py reads them)
    **{name: ("servelm.quant.codes_method:CodesMethod", {})
       for name in ("gptq", "awq", "compressed-tensors")},
}


def quant_method_names() -> list[str]:
    return list(_METHODS)


def get_quant_method(name: str, activations: str = "float") -> QuantMethod:
    """The method `name`; activations: "float" | "int8" | "auto", what its CPU kernels
    compute with (servelm/quant/int8_act.py)."""
    try:
        target, kwargs = _METHODS[name]
    except KeyError:
        from servelm.protocol import InvalidParameterError  # torch-free

        raise InvalidParameterError(f"quantization {name!r} is not supported; supported: "
                                    f"{quant_method_names()}", param="quantization") from None
    module, factory = target.split(":")
    return getattr(importlib.import_module(module), factory)(name=name, activations=activations,
                                                             **kwargs)


def make_linear(in_features: int, out_features: int, bias: bool = False,
                quant: QuantMethod | None = None, is_lm_head: bool = False):
    """The model's one way to get a linear layer: float without `quant`, else staged."""
    from servelm.quant.staged_linear import make_linear as _make

    return _make(in_features, out_features, bias, quant, is_lm_head)


def finalize_linears(model) -> None:
    """Replace every StagedLinear under `model` by its quantized layer (after loading)."""
    from servelm.quant.staged_linear import finalize_linears as _finalize

    _finalize(model)
