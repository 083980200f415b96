"""Phi-3: the Llama decoder with q/k/v and gate/up already fused in the checkpoint
(qkv_proj, gate_up_proj), LongRoPE scaling for its long-context variants (layers/rotary.py)
and, for the 4k models, a sliding window."""

from __future__ import annotations

from torch import nn

from servelm.config import ModelConfig
from servelm.models.decoder import DecoderLayer, DecoderLM, GatedMLP, make_rotary


class Phi3ForCausalLM(DecoderLM):
    family = "phi3"
    checkpoint_packed = ("qkv_proj", "gate_up_proj")  # loaded as they are (no rule)

    def __init__(self, config: ModelConfig, backend, quant=None):
        super().__init__(config, quant)
        rotary = make_rotary(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, backend,
                         GatedMLP(config.hidden_size, config.intermediate_size,
                                  config.hidden_act))
            for i in range(config.num_layers))
