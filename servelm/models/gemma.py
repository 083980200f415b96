"""Gemma 2 and Gemma 3 (text): GeGLU MLPs, RMSNorms that scale by (1 + w), a norm after
attention and after the MLP as well as before each, the embedding multiplied by
sqrt(hidden), attention scaled by query_pre_attn_scalar, and sliding-window layers
alternating with global ones (ModelConfig.layer_types).

Gemma 2 soft-caps the attention scores and the output logits (tanh); Gemma 3 drops the
soft-caps for per-head q/k norms and gives its sliding layers their own rope base
(rope_local_theta) while the global layers take the configured rope scaling.
"""

from __future__ import annotations

from torch import nn

from servelm.config import ModelConfig
from servelm.layers.norm import GemmaRMSNorm
from servelm.models.decoder import Attention, DecoderLM, GatedMLP, gate_up_rule, make_rotary, \
    qkv_rule


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, config: ModelConfig, layer: int, rotary, backend):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(config, layer, rotary, backend, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, residual, batch):
        """The hidden state is x + residual (x alone before the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(DecoderLM):
    family = "gemma2"

    def __init__(self, config: ModelConfig, backend, quant=None):
        super().__init__(config, quant)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size ** 0.5
        global_rope, local_rope = make_rotary(config), make_rotary(config, local=True)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i,
                              local_rope if config.is_sliding_layer(i) else global_rope, backend)
            for i in range(config.num_layers))
        self.rules = (qkv_rule(config, self.packed_modules),
                      gate_up_rule(self.packed_modules, "mlp", config.intermediate_size))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = "gemma3_text"
