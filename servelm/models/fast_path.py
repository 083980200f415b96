"""A model's fast path: what the C++ decode stack (cpu_kernels/decode_stack.cpp) needs to
run its decode steps, described by the model, or the reason it cannot.

Owns: `describe(model)`, the one place that reads a decoder frame's layers for the stack:
per layer its norms (each as the tensor it scales by: a (1 + w) norm's is w + 1; sandwich
norms after attention and the MLP where the family has them), its attention (GQA: shape and
variant, the layer's rotary table, sliding window, soft-cap, query scaling, q/k norms,
biases; or multi-head latent attention, MLA: the q path, the latent's projection and norm,
the key/value up-projection the decode absorbs, the rope channels' order, the softmax scale)
and its MLP (a gated MLP with SiLU or tanh-GELU, or a mixture of experts: router, routing,
each expert, the shared expert and its gate), every linear in the stack's order.
Each linear's packed form comes from the linear itself (quant/decode_entry.py) when the
runner builds the stack, since the runner chooses the linears' kernels after the model is
built. Never: chooses whether a step takes the stack, or reads the KV cache or the
attention backend (the runner does both: runner/cpu_decode.py).

    model (DecoderLM) --describe--> DecodeStackSpec | Refusal("layer 3: ...")
    runner/cpu_decode.py: spec + KV cache + backend -> DecodeStack(tensors, ints, floats)

The embedding's scale (Gemma) and the logits' soft-cap are the model's own steps before and
after the stack (DecoderLM.embed, compute_logits). What the stack cannot take yet, and the
reason the spec gives: partial rotary and M-RoPE positions, experts placed across ranks,
norms of two eps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# the stack's activations (decode_stack.cpp's Activation)
ACT_SILU, ACT_GELU_TANH = 0, 1


@dataclass(frozen=True)
class Refusal:
    """Why a model has no decode-stack form: the first layer (None: the model) and part the
    stack does not implement."""

    reason: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.reason if self.layer is None else f"layer {self.layer}: {self.reason}"


class ExpertMatrix:
    """One routed expert's matrix, a view of the layer's stacked weight ([E, out, in]), as
    a linear: Experts computes `x @ w[e].t()`, which is at::linear's float entry."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def decode_entry(self):
        from servelm.quant.decode_entry import KIND_FLOAT, plain_entry

        w = self.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
            return None
        return plain_entry(KIND_FLOAT, self, w, None)


@dataclass(frozen=True, eq=False)
class StackMLP:
    """down(act(gate) * up) over gate_up's [gate | up] rows."""

    activation: int  # ACT_SILU | ACT_GELU_TANH
    gate_up_proj: nn.Module
    down_proj: nn.Module

    def named_linears(self, prefix: str) -> list[tuple[str, nn.Module]]:
        return [(f"{prefix}gate_up_proj", self.gate_up_proj), (f"{prefix}down_proj",
                                                               self.down_proj)]


@dataclass(frozen=True, eq=False)
class StackMoE:
    """servelm/layers/moe.py's MoE: the router and its RoutingConfig, E experts, the shared
    expert (optionally behind a sigmoid gate)."""

    router: nn.Module
    routing: object  # layers/moe.py RoutingConfig
    score_bias: torch.Tensor | None
    routed_tokens: torch.Tensor  # Experts.num_routed_tokens, counted by the stack too
    experts: tuple[StackMLP, ...]
    shared: StackMLP | None
    shared_gate: nn.Module | None

    def named_linears(self, prefix: str) -> list[tuple[str, nn.Module]]:
        named = [(f"{prefix}gate", self.router)]
        for e, expert in enumerate(self.experts):
            named += expert.named_linears(f"{prefix}experts.{e}.")
        if self.shared is not None:
            named += self.shared.named_linears(f"{prefix}shared.")
        if self.shared_gate is not None:
            named.append((f"{prefix}shared_gate", self.shared_gate))
        return named


@dataclass(frozen=True, eq=False)
class StackAttention:
    """GQA attention (models/decoder.py Attention) as a decode step runs it: q, k, v =
    qkv(h); q/k norms; rotary; q *= q_mult; paged decode (window, soft-cap); o."""

    q_norm: torch.Tensor | None  # per head, before rotary (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    cos: torch.Tensor  # the layer's rotary table [positions, D/2]
    sin: torch.Tensor
    window: int  # keys a query attends (0: all)
    softcap: float  # attention scores' tanh cap (0: none)
    q_mult: float  # q's factor after rotary (query_pre_attn_scalar; 1.0: none)
    qkv_proj: nn.Module
    o_proj: nn.Module

    def named_linears(self) -> list[tuple[str, nn.Module]]:
        return [("qkv_proj", self.qkv_proj), ("o_proj", self.o_proj)]


@dataclass(frozen=True, eq=False)
class StackMLA:
    """Multi-head latent attention (models/deepseek.py MLAttention) as its decode runs it,
    absorbed: q = q_proj(h), or q_b(norm(q_a(h))), split per head into [q_nope | q_pe];
    [c | k_pe] = kv_a(h), c normed; q_pe and k_pe reordered by rope_perm and rotated; the
    entry [c | k_pe] stored; q_lat = [q_nope W_k | q_pe] against the entries (the latent
    kernel, scale), its latent output times W_v, then o. W_k, W_v: kv_b_weight's rows per
    head [Dn | Dv]."""

    num_heads: int
    nope: int  # Dn: each head's key channels without rope
    rope: int  # R: the rope key's channels (shared by the heads)
    v_dim: int  # Dv
    latent: int  # L: kv_lora_rank
    scale: float  # the softmax's, YaRN's mscale folded in (deepseek.py mla_softmax_scale)
    cos: torch.Tensor  # the rope table [positions, R/2]
    sin: torch.Tensor
    q_proj: nn.Module | None  # q from h directly; else q_b(norm(q_a(h)))
    q_a_proj: nn.Module | None
    q_a_norm: torch.Tensor | None
    q_b_proj: nn.Module | None
    kv_a_proj: nn.Module  # h -> [c | k_pe]
    kv_a_norm: torch.Tensor
    kv_b_weight: torch.Tensor  # [H * (Dn + Dv), L], a plain tensor
    rope_perm: torch.Tensor  # [R] int64: interleaved rope pairs -> rotate-half order
    o_proj: nn.Module

    def named_linears(self) -> list[tuple[str, nn.Module]]:
        q = ([("q_proj", self.q_proj)] if self.q_proj is not None else
             [("q_a_proj", self.q_a_proj), ("q_b_proj", self.q_b_proj)])
        return [*q, ("kv_a_proj_with_mqa", self.kv_a_proj), ("o_proj", self.o_proj)]


@dataclass(frozen=True, eq=False)
class StackLayer:
    """One decoder layer as the stack runs it: x + attention(norm(x)), then
    + mlp(norm(.)); with sandwich norms (pre/post-feedforward norms set) a norm of the
    attention's and of the MLP's output as well (DecoderLayer)."""

    kv_layer: int  # its layer in the KV cache
    input_norm: torch.Tensor  # each norm: the tensor the normalised row is multiplied by
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor | None  # sandwich norms (Gemma); else None
    post_feedforward_norm: torch.Tensor | None
    attention: StackAttention | StackMLA
    mlp: StackMLP | StackMoE

    @property
    def sandwich(self) -> bool:
        return self.pre_feedforward_norm is not None

    @property
    def has_experts(self) -> bool:
        return isinstance(self.mlp, StackMoE)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.attention, StackMLA)

    def named_linears(self) -> list[tuple[str, nn.Module]]:
        """Every linear in the stack's order, named as in the layer."""
        prefix = "mlp." if isinstance(self.mlp, StackMoE) else ""
        return [*self.attention.named_linears(), *self.mlp.named_linears(prefix)]

    @property
    def linears(self) -> list[nn.Module]:
        return [m for _, m in self.named_linears()]


@dataclass(frozen=True, eq=False)
class DecodeStackSpec:
    """A model's layers as the C++ decode stack takes them. An MLA model's attention shape
    is the absorbed form's: one KV head of the entry's width (L + R)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # every norm's, the final one's included
    final_norm: torch.Tensor
    layers: tuple[StackLayer, ...]

    @property
    def linears(self) -> list[nn.Module]:
        return [m for layer in self.layers for m in layer.linears]

    @property
    def has_experts(self) -> bool:
        return any(layer.has_experts for layer in self.layers)

    @property
    def has_mla(self) -> bool:
        return any(layer.is_mla for layer in self.layers)


def describe(model: nn.Module) -> DecodeStackSpec | Refusal:
    """The decode-stack form of a decoder frame (models/decoder.py DecoderLM)."""
    from servelm.layers.norm import RMSNorm
    from servelm.models.decoder import DecoderLM

    if not isinstance(model, DecoderLM):
        return Refusal(f"{type(model).__name__} is not a decoder frame (models/decoder.py)")
    if not isinstance(model.norm, RMSNorm):
        return Refusal(f"{type(model.norm).__name__} norms are not in the stack")
    eps = model.norm.eps
    layers = []
    for i, layer in enumerate(model.layers):
        described = _layer(layer, eps)
        if isinstance(described, str):
            return Refusal(described, i)
        layers.append(described)
    if not layers:
        return Refusal("a model without layers")
    attn = model.layers[0].self_attn
    if layers[0].is_mla:
        a = layers[0].attention
        shape = (a.num_heads, 1, a.latent + a.rope)
    else:
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    return DecodeStackSpec(*shape, float(eps), _scale(model.norm), tuple(layers))


def _scale(norm: nn.Module) -> torch.Tensor:
    return norm.scale().detach()


def _layer(layer: nn.Module, eps: float) -> StackLayer | str:
    """The stack's form of one decoder layer, or why it has none."""
    sandwich = layer.sandwich
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    why = _norms_refusal(norms, eps)
    if why is not None:
        return why
    attention = _attention(layer.self_attn, eps)
    if isinstance(attention, str):
        return attention
    mlp = _mlp(layer.mlp)
    if isinstance(mlp, str):
        return mlp
    return StackLayer(
        layer.self_attn.layer, _scale(layer.input_layernorm),
        _scale(layer.post_attention_layernorm),
        _scale(layer.pre_feedforward_layernorm) if sandwich else None,
        _scale(layer.post_feedforward_layernorm) if sandwich else None, attention, mlp)


def _norms_refusal(norms: list, eps: float) -> str | None:
    from servelm.layers.norm import RMSNorm

    for norm in filter(None, norms):
        if not isinstance(norm, RMSNorm):
            return f"{type(norm).__name__} norms are not in the stack"
        if norm.eps != eps:
            return f"norms of two eps ({norm.eps} and {eps}) are not in the stack"
    return None


def _rotary_refusal(rotary: nn.Module, dim: int) -> str | None:
    from servelm.layers.rotary import RotaryEmbedding

    if type(rotary).forward is not RotaryEmbedding.forward:
        return f"{type(rotary).__name__} positions are not in the stack"
    if rotary.rotary_dim != dim:
        return "partial rotary embedding is not in the stack"
    return None


def _attention(attn: nn.Module, eps: float) -> StackAttention | StackMLA | str:
    """The stack's form of a layer's attention, GQA or latent, or why it has none."""
    from servelm.models.decoder import Attention
    from servelm.models.deepseek import MLAttention

    if type(attn) is MLAttention:
        return _mla(attn, eps)
    if type(attn) is not Attention:
        return f"{type(attn).__name__} (neither GQA nor latent attention) is not in the stack"
    why = (_rotary_refusal(attn.rotary, attn.head_dim)
           or _norms_refusal([attn.q_norm, attn.k_norm], eps))
    if why is not None:
        return why
    optional = (lambda norm: None if norm is None else _scale(norm))
    return StackAttention(
        optional(attn.q_norm), optional(attn.k_norm),
        attn.rotary.cos.contiguous(), attn.rotary.sin.contiguous(),
        int(attn.window), float(attn.softcap or 0.0), float(attn.q_mult),
        attn.qkv_proj, attn.o_proj)


def _mla(attn: nn.Module, eps: float) -> StackMLA | str:
    from servelm.models.deepseek import rope_permutation

    low_rank = attn.q_proj is None
    why = (_rotary_refusal(attn.rotary, attn.rope)
           or _norms_refusal([attn.kv_a_layernorm, attn.q_a_layernorm if low_rank else None],
                             eps))
    if why is not None:
        return why
    return StackMLA(
        attn.num_heads, attn.nope, attn.rope, attn.v_dim, attn.latent, float(attn.scale),
        attn.rotary.cos.contiguous(), attn.rotary.sin.contiguous(), attn.q_proj,
        attn.q_a_proj if low_rank else None, _scale(attn.q_a_layernorm) if low_rank else None,
        attn.q_b_proj if low_rank else None, attn.kv_a_proj_with_mqa,
        _scale(attn.kv_a_layernorm), attn.kv_b_weight.detach(), rope_permutation(attn.rope),
        attn.o_proj)


def _activation(fn) -> int | str:
    from servelm.layers.activation import gelu_tanh_and_mul, silu_and_mul

    if fn is silu_and_mul:
        return ACT_SILU
    if fn is gelu_tanh_and_mul:
        return ACT_GELU_TANH
    return f"the MLP activation {getattr(fn, '__name__', fn)} is not in the stack"


def _mlp(mlp: nn.Module) -> StackMLP | StackMoE | str:
    """The stack's form of a dense gated MLP or a mixture of experts, or why it has none."""
    from servelm.layers.moe import MoE, Experts
    from servelm.models.decoder import GatedMLP

    if type(mlp) is GatedMLP:
        act = _activation(mlp.act_and_mul)
        return act if isinstance(act, str) else StackMLP(act, mlp.gate_up_proj, mlp.down_proj)
    if type(mlp) is not MoE:
        return f"{type(mlp).__name__} (not a gated MLP or MoE) is not in the stack"
    experts = mlp.experts
    if type(experts) is not Experts:
        return f"{type(experts).__name__} (experts placed across ranks) are not in the stack"
    act = _activation(experts.act_and_mul)
    if isinstance(act, str):
        return act
    if experts.w13 is not None:
        routed = tuple(StackMLP(act, ExpertMatrix(experts.w13[e]), ExpertMatrix(experts.w2[e]))
                       for e in range(experts.num_experts))
    else:  # quantized: each expert's two layers (servelm/quant)
        routed = tuple(StackMLP(act, experts.q13[e], experts.q2[e])
                       for e in range(experts.num_experts))
    shared = None
    if mlp.shared is not None:
        shared = _mlp(mlp.shared)
        if not isinstance(shared, StackMLP):
            return f"the shared expert: {shared}" if isinstance(shared, str) else \
                "a shared expert that is not a gated MLP is not in the stack"
    return StackMoE(mlp.gate, mlp.routing, mlp.score_bias, experts.num_routed_tokens, routed,
                    shared, mlp.shared_gate)
