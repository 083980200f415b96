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


def gate_up_silu(gate_up: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up(x)); in one pass where the layer (a MixedLinear's form for x's
    rows) has a fused form (DotLinear, servelm/layers/dot_linear.py) and nothing hooks its
    output (a LoRA batch's hooks add to the gate and up, servelm/lora/manager.py)."""
    from servelm.quant.mixed_linear import MixedLinear

    layer = gate_up.form(x) if type(gate_up) is MixedLinear else gate_up
    fused = getattr(layer, "silu_and_mul", None)
    if fused is not None and not any(m._forward_hooks or m._forward_pre_hooks
                                     for m in (gate_up, layer)):
        return fused(x)
    return silu_and_mul(gate_up(x))


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
