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
The C++ decode stack runs the same decode ops (models/fast_path.py StackMLA).

Multi-token prediction (DeepSeek-V3, `num_nextn_predict_layers`): the checkpoint stores its MTP
modules as layers past the decoder's (model.layers.{L}.*: enorm, hnorm, eh_proj, a full decoder
layer with MLA and MoE, shared_head.norm / shared_head.head). The model skips them at load; with
--speculative-method mtp the engine builder hands them to `build_mtp`, which builds the first
as a MultiTokenPredictor for the drafter (servelm/spec/mtp.py). Never: the drafter's cache or
chain (spec/ owns those).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.models.decoder import WEIGHT_ONLY_METHODS, DecoderLM, Placement, expert_rules, \
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


def rope_permutation(rope: int) -> torch.Tensor:
    """The channel order that takes DeepSeek's interleaved rope pairs (x0, x1), (x2, x3), ...
    to the rotate-half layout: evens, then odds (the decode stack takes the same order)."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


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
        perm = rope_permutation(self.rope)
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
        skipped at load, said once (--speculative-method mtp takes them before they get
        here: `build_mtp`)."""
        if mtp_module_index(name, self.config) is not None:
            if not getattr(self, "_mtp_said", False):
                self._mtp_said = True
                logger.info("skipping layer %d and beyond: multi-token-prediction modules "
                            "(the model has %d layers); --speculative-method mtp drafts with "
                            "them", self.config.num_layers, self.config.num_layers)
            return None
        return super().place(name)

    def build_mtp(self, tensors: Iterable[tuple[str, torch.Tensor]], backend
                  ) -> MultiTokenPredictor:
        """The checkpoint's first multi-token-prediction module from its `tensors`
        (model.layers.{L}.*), float, on this model's device and dtype; its attention runs on
        `backend` (the drafter's own cache). Later modules are not kept: the drafter chains
        the first. Its decoder layer's tensors are placed by this family's rules."""
        c = self.config
        mine = {n.removeprefix("model."): t for n, t in tensors
                if mtp_module_index(n, c) == 0}
        if not mine:
            raise ValueError(f"{c.name or c.architecture}: the checkpoint has no tensors of "
                             f"its multi-token-prediction module (model.layers.{c.num_layers}"
                             ".*) for speculative_method 'mtp'")
        has_head = f"layers.{c.num_layers}.shared_head.head.weight" in mine
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        with torch.device("meta"):
            layer = self.make_layer(c, c.num_layers, self.make_rotaries(c)[0], backend, None)
            mtp = MultiTokenPredictor(c, layer, has_head)
        mtp = mtp.to_empty(device=device).to(dtype)
        mtp.layer.self_attn.rotary.materialize(device)
        self._load_mtp(mtp, mine)
        return mtp.eval()

    def _load_mtp(self, mtp: MultiTokenPredictor, tensors: dict[str, torch.Tensor]) -> None:
        prefix = f"layers.{self.config.num_layers}."
        saved = set(mtp.state_dict())  # parameters and persistent buffers (score_bias)
        params = {n: t for n, t in [*mtp.named_buffers(), *mtp.named_parameters()]
                  if n in saved}
        filled = dict.fromkeys(params, 0)
        for name, tensor in tensors.items():
            part = name[len(prefix):]
            if part == "embed_tokens.weight":
                continue  # a copy of the model's own: the drafter embeds with the model's
            if part.split(".")[0] in _MTP_PARTS:
                p = Placement(_MTP_PARTS[part.split(".")[0]] + part.partition(".")[2])
            else:
                p = DecoderLM.place(self, name)  # the decoder layer's: this family's rules
                p = p and p._replace(target="layer." + p.target[len(prefix):])
            if p is None or p.target not in params:
                raise ValueError(f"checkpoint tensor model.{name} has no place in the "
                                 "multi-token-prediction module")
            if not isinstance(tensor, torch.Tensor):  # GGUF blocks: the module runs in float
                tensor = tensor.dequantize()
            self._copy(p, name, params[p.target], tensor.to(params[p.target].dtype))
            filled[p.target] += tensor.numel()
        missing = [n for n, t in params.items() if filled[n] != t.numel()]
        if missing:
            raise ValueError(f"the multi-token-prediction module lacks tensors: {missing[:8]}")
        for name, buf in mtp.named_buffers():
            if name.endswith("num_routed_tokens"):
                buf.zero_()

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


# the MTP module's own parts (checkpoint name's first component -> its parameter's prefix)
_MTP_PARTS = {"enorm": "enorm.", "hnorm": "hnorm.", "eh_proj": "eh_proj.",
              "shared_head": "shared_head_"}


def mtp_module_index(name: str, config: ModelConfig) -> int | None:
    """j for a tensor of multi-token-prediction module j (model.layers.{L + j}.*, L the
    decoder's layers); None for any other tensor."""
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    if m is None or int(m[1]) < config.num_layers:
        return None
    return int(m[1]) - config.num_layers


class MultiTokenPredictor(nn.Module):
    """One DeepSeek-V3 multi-token-prediction module. At position i, from the hidden state
    h_i that predicted token i + 1 and that token's embedding:

        x      = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])       (2 H -> H)
        out    = shared_head.norm(layer(x))       the layer: MLA + MoE, this family's own
        logits = shared_head.head(out), or the model's head where the checkpoint has none

    `out` predicts token i + 2 and is the next chain step's h."""

    def __init__(self, config: ModelConfig, layer: nn.Module, has_head: bool):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = _linear(2 * h, h)
        self.layer = layer
        self.shared_head_norm = RMSNorm(h, eps)
        self.shared_head_head = _linear(h, config.vocab_size) if has_head else None

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                batch) -> torch.Tensor:
        """hidden, embeds [T, H] -> out [T, H] (normed: the head's input)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x, residual = self.layer(positions, x, None, batch)
        return self.shared_head_norm(x, residual)[0]
