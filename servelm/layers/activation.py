"""Gated activations."""

import torch
import torch.nn.functional as F

from servelm.layers.fused_cpu import fused_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] holding [gate | up] -> silu(gate) * up: [T, I]."""
    ops = fused_ops(x)
    if ops is not None and x.dim() == 2 and x.is_contiguous():
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
