"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) and MoE with shared experts
after `num_leading_dense_layers` dense layers; V3 routes by sigmoid scores with a correction
bias over groups of experts (servelm/layers/moe.py).

MLA: a token's cache entry is its normed latent c [L = kv_lora_rank] and one rope key k_pe
[R = qk_rope_head_dim] shared by all heads (attention/kv_cache.py). kv_b_proj W [H*(Dn+Dv), L]
up-projects c to each head's key (nope part, W_k [H, Dn, L]) and value (W_v [H, Dv, L]).

    prefill (explicit):  k = [c W_k^T | k_pe], v = c W_v^T; attention over Dn+R, out [Dv]
    decode (absorbed):   q_lat = [q_nope W_k | q_pe] against the entries [c | k_pe] (one
                         KV head of L+R), values c: out_lat [L]; out = out_lat W_v^T

Both give softmax((q_nope.k_nope + q_pe.k_pe) * scale) v exactly. DeepSeek's rope rotates
interleaved pairs (x0, x1), (x2, x3), ...; q_pe and k_pe are permuted to the rotate-half layout
(evens, then odds) before the rotary and stay so: a dot product does not see the order.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.models.decoder import WEIGHT_ONLY_METHODS, Placement, expert_rules, \
    gate_up_rule
from servelm.models.mixtral import MixtralForCausalLM

logger = logging.getLogger(__name__)


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    linear = nn.Linear(n_in, n_out, bias=bias)
    linear.requires_grad_(False)
    return linear


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(Dn+R), times YaRN's mscale(factor, mscale_all_dim)^2 when the rope has one."""
    scale = config.qk_head_dim ** -0.5
    s = config.rope_scaling or {}
    m_all = s.get("mscale_all_dim")
    factor = float(s.get("factor") or 1.0)
    if s.get("rope_type", "default") != "default" and m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend):
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads = c.num_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.latent = c.kv_lora_rank
        qk = c.qk_head_dim
        if c.q_lora_rank:
            self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank, c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = _linear(c.q_lora_rank, c.num_heads * qk)
            self.q_proj = None
        else:
            self.q_proj = _linear(c.hidden_size, c.num_heads * qk)
        self.kv_a_proj_with_mqa = _linear(c.hidden_size, self.latent + self.rope,
                                          c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, c.rms_norm_eps)
        # A plain tensor, not a Linear: decode reads it as W_k / W_v (a packed Linear's
        # weight is in oneDNN's layout).
        self.kv_b_weight = nn.Parameter(torch.empty(c.num_heads * (self.nope + self.v_dim),
                                                    self.latent), requires_grad=False)
        self.o_proj = _linear(c.num_heads * self.v_dim, c.hidden_size, c.attention_bias)
        self.rotary = rotary
        self.backend = backend
        self.scale = mla_softmax_scale(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch):
        t, h = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_proj is not None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        perm = torch.cat((torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)))
        q_pe = q_pe.index_select(-1, perm.to(q_pe.device)).contiguous()
        k_pe = k_pe.index_select(-1, perm.to(k_pe.device)).reshape(t, 1, self.rope)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.contiguous())
        entry = torch.cat((latent, k_pe[:, 0]), dim=-1)  # [T, L+R]
        w = self.kv_b_weight.view(h, self.nope + self.v_dim, self.latent)
        w_k, w_v = w[:, :self.nope], w[:, self.nope:]  # [H, Dn, L], [H, Dv, L]
        nd = batch.num_decodes
        q_decode = torch.cat((torch.einsum("thn,hnl->thl", q_nope[:nd], w_k), q_pe[:nd]), -1)
        q_prefill = torch.cat((q_nope[nd:], q_pe[nd:]), dim=-1)
        decode_lat, prefill_out = self.backend.forward_mla(
            self.layer, entry, batch, q_decode, q_prefill, self._expand, self.scale,
            self.latent)
        parts = []
        if nd:
            parts.append(torch.einsum("thl,hvl->thv", decode_lat, w_v))
        if t > nd:
            parts.append(prefill_out)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _expand(self, entries: torch.Tensor):
        """entries [C, L+R] -> keys [C, H, Dn+R], values [C, H, Dv]."""
        c, h = entries.shape[0], self.num_heads
        kv = (entries[:, :self.latent] @ self.kv_b_weight.t()).view(c, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = entries[:, None, self.latent:].expand(c, h, self.rope)
        return torch.cat((k_nope, k_pe), dim=-1), v


class DeepseekV2ForCausalLM(MixtralForCausalLM):
    family = "deepseek_v2"
    # int8 / int4 weight-only: the q, kv_a and o projections, dense and shared MLPs, every
    # routed expert and the head (decoder.py); kv_b stays float (a plain tensor, not a
    # Linear): decode absorbs it into the query and the output, which a quantized layer's
    # packed codes cannot be
    quant_methods = WEIGHT_ONLY_METHODS

    def __init__(self, config: ModelConfig, backend=None, quant=None):
        if not config.is_mla:
            raise ValueError(f"{config.architecture}: kv_lora_rank must be positive (MLA)")
        super().__init__(config, backend, quant)

    def make_rotaries(self, config: ModelConfig):
        return [RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings,
                                config.rope_theta, config.rope_scaling)] * config.num_layers

    def place(self, name: str) -> Placement | None:
        """DeepSeek-V3 checkpoints carry num_nextn_predict_layers multi-token-prediction
        modules as layers past num_hidden_layers (model.layers.61.* for a 61-layer model):
        skipped at load, said once; servelm's speculative decoding uses its own proposers."""
        m = re.match(r"layers\.(\d+)\.", name)
        if m is not None and int(m[1]) >= self.config.num_layers:
            if not getattr(self, "_mtp_said", False):
                self._mtp_said = True
                logger.info("skipping layer %s and beyond: multi-token-prediction modules "
                            "(the model has %d layers); not used as a draft", m[1],
                            self.config.num_layers)
            return None
        return super().place(name)

    def make_attention(self, config: ModelConfig, layer: int, rotary, backend, quant):
        return MLAttention(config, layer, rotary, backend)  # quantized after loading

    def weight_rules(self, config: ModelConfig) -> tuple:
        shared = config.shared_expert_intermediate_size
        return (
            (r"(.*)\.self_attn\.kv_b_proj\.weight",
             lambda m: Placement(f"{m[1]}.self_attn.kv_b_weight")),
            (r"(.*)\.mlp\.gate\.e_score_correction_bias",
             lambda m: Placement(f"{m[1]}.mlp.score_bias")),
            *expert_rules(self.packed_modules, config.moe_intermediate_size),
            gate_up_rule(self.packed_modules, "mlp.shared_experts", shared, "mlp.shared"),
            (r"(.*)\.mlp\.shared_experts\.down_proj\.weight",
             lambda m: Placement(f"{m[1]}.mlp.shared.down_proj.weight")),
            gate_up_rule(self.packed_modules, "mlp", config.intermediate_size),
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    family = "deepseek_v3"
