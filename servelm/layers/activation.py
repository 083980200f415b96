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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] holding [gate | up] -> gelu_tanh(gate) * up: [T, I] (GeGLU, Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_ACT_AND_MUL = {"silu": silu_and_mul, "swish": silu_and_mul,
                "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def act_and_mul(hidden_act: str):
    """The gated activation for a config's `hidden_act`; an unknown one is refused by name."""
    try:
        return _ACT_AND_MUL[hidden_act]
    except KeyError:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported "
                         f"(supported: {sorted(_ACT_AND_MUL)})") from None
