"""A model's fast path: what the C++ decode stack (cpu_kernels/decode_stack.cpp) needs to
run its decode steps, described by the model, or the reason it cannot.

Owns: `describe(model)`, the one place that reads a decoder frame's layers for the stack:
per layer its norms (plain RMSNorm, one eps), its attention's shape and variant (GQA, full
rotary from one table, no window, no soft-cap, no query scaling; q/k norms and biases are
in the stack) and its four linears in the stack's order. Each linear's packed form comes
from the linear itself (quant/decode_entry.py) when the runner builds the stack, since the
runner chooses the linears' kernels after the model is built. Never: chooses whether a step
takes the stack, or reads the KV cache or the attention backend (the runner does both:
runner/cpu_decode.py).

    model (DecoderLM) --describe--> DecodeStackSpec | Refusal("layer 3: ...")
    runner/cpu_decode.py: spec + KV cache + backend -> DecodeStack(tensors, ints, floats)

What the stack cannot take yet, and the reason the spec gives: the embedding scaled by
sqrt(hidden) and (1 + w) norms and the norms after attention and the MLP (Gemma), attention
soft-caps, sliding windows and query_pre_attn_scalar, GeGLU, partial rotary and M-RoPE,
mixtures of experts, multi-head latent attention (MLA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Refusal:
    """Why a model has no decode-stack form: the first layer (None: the model) and part the
    stack does not implement."""

    reason: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.reason if self.layer is None else f"layer {self.layer}: {self.reason}"


@dataclass(frozen=True, eq=False)
class StackLayer:
    """One decoder layer as the stack runs it: x + o(attn(qkv(norm(x)))), then
    + down(silu_and_mul(gate_up(norm(.))))."""

    kv_layer: int  # its layer in the KV cache
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None  # per head, before rotary (Qwen3)
    k_norm: torch.Tensor | None
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module

    @property
    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The four linears in the stack's order."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj


@dataclass(frozen=True, eq=False)
class DecodeStackSpec:
    """A model's layers as the C++ decode stack takes them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # every norm's, the final one's included
    cos: torch.Tensor  # the rotary table [positions, D/2]
    sin: torch.Tensor
    final_norm: torch.Tensor
    layers: tuple[StackLayer, ...]

    @property
    def linears(self) -> list[nn.Module]:
        return [m for layer in self.layers for m in layer.linears]


def describe(model: nn.Module) -> DecodeStackSpec | Refusal:
    """The decode-stack form of a decoder frame (models/decoder.py DecoderLM)."""
    from servelm.layers.norm import RMSNorm
    from servelm.layers.rotary import RotaryEmbedding
    from servelm.models.decoder import DecoderLM

    if not isinstance(model, DecoderLM):
        return Refusal(f"{type(model).__name__} is not a decoder frame (models/decoder.py)")
    if model.embed_scale != 1.0:
        return Refusal("the embedding scaled by sqrt(hidden) is not in the stack")
    if type(model.norm) is not RMSNorm:
        return Refusal(f"{type(model.norm).__name__} (1 + w) norms are not in the stack")
    eps = model.norm.eps
    layers = []
    first = None
    for i, layer in enumerate(model.layers):
        why = _refusal(layer, eps, RMSNorm, RotaryEmbedding)
        if why is not None:
            return Refusal(why, i)
        attn, mlp = layer.self_attn, layer.mlp
        first = first or attn
        if attn.rotary is not first.rotary:
            return Refusal("a rotary table of its own is not in the stack (one table)", i)
        layers.append(StackLayer(
            attn.layer, layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            None if attn.q_norm is None else attn.q_norm.weight.detach(),
            None if attn.k_norm is None else attn.k_norm.weight.detach(),
            attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    if first is None:
        return Refusal("a model without layers")
    return DecodeStackSpec(first.num_heads, first.num_kv_heads, first.head_dim, float(eps),
                           first.rotary.cos.contiguous(), first.rotary.sin.contiguous(),
                           model.norm.weight.detach(), tuple(layers))


def _refusal(layer: nn.Module, eps: float, rms_norm: type, rotary: type) -> str | None:
    """Why the stack cannot run this decoder layer, or None."""
    from servelm.layers.activation import silu_and_mul
    from servelm.models.decoder import Attention, GatedMLP

    if layer.sandwich:
        return "norms after attention and after the MLP are not in the stack"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention:
        return f"{type(attn).__name__} (not GQA attention) is not in the stack"
    if type(mlp) is not GatedMLP:
        return f"{type(mlp).__name__} (not a dense gated MLP) is not in the stack"
    if mlp.act_and_mul is not silu_and_mul:
        return f"the MLP activation {mlp.act_and_mul.__name__} is not in the stack (SiLU only)"
    if attn.window:
        return f"a sliding window of {attn.window} keys is not in the stack"
    if attn.softcap:
        return "attention soft-capping is not in the stack"
    if attn.q_mult != 1.0:
        return "query_pre_attn_scalar (query scaling) is not in the stack"
    if type(attn.rotary).forward is not rotary.forward:
        return f"{type(attn.rotary).__name__} positions are not in the stack"
    if attn.rotary.rotary_dim != attn.head_dim:
        return "partial rotary embedding is not in the stack"
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    for norm in filter(None, norms):
        if type(norm) is not rms_norm:
            return f"{type(norm).__name__} (1 + w) norms are not in the stack"
        if norm.eps != eps:
            return f"norms of two eps ({norm.eps} and {eps}) are not in the stack"
    return None
