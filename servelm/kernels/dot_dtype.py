"""dot_dtype: the dtype the attention kernels feed to tl.dot, and its precision mode.

Owns one decision shared by the attention kernels. On a GPU, tl.dot takes the activations'
own dtype (bf16/fp16 tensor cores; fp32 as exact "ieee", not tf32, so fp32 parity holds). Under
TRITON_INTERPRET=1, Triton 3.9's tl.dot returns garbage for bf16 inputs (numpy has no bf16),
so the interpreter computes bf16 dots in fp32: loads, stores and the softmax are unchanged, only
the dot's input rounding differs from the GPU path.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(tl dtype for tl.dot inputs, input_precision) for activations of `dtype`."""
    if dtype not in _TL:
        raise ValueError(f"attention kernels support {sorted(map(str, _TL))}, got {dtype}")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreting()):
        return tl.float32, "ieee"
    return _TL[dtype], "tf32"  # precision only applies to fp32 inputs
