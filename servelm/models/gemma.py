"""Gemma 2 and Gemma 3 (text): GeGLU MLPs, RMSNorms that scale by (1 + w), a norm after
attention and after the MLP as well as before each (sandwich norms), the embedding
multiplied by sqrt(hidden), attention scaled by query_pre_attn_scalar, and sliding-window
layers alternating with global ones (ModelConfig.layer_types).

Gemma 2 soft-caps the attention scores and the output logits (tanh); Gemma 3 drops the
soft-caps for per-head q/k norms and gives its sliding layers their own rope base
(rope_local_theta) while the global layers take the configured rope scaling.
"""

from __future__ import annotations

from servelm.config import ModelConfig
from servelm.layers.norm import GemmaRMSNorm
from servelm.models.decoder import DecoderLM, make_rotary


class Gemma2ForCausalLM(DecoderLM):
    family = "gemma2"
    norm_class = GemmaRMSNorm
    sandwich_norms = True
    scales_embedding = True

    def make_rotaries(self, config: ModelConfig):
        global_rope, local_rope = make_rotary(config), make_rotary(config, local=True)
        return [local_rope if config.is_sliding_layer(i) else global_rope
                for i in range(config.num_layers)]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = "gemma3_text"
