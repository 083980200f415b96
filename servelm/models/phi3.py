"""Phi-3: the decoder frame with q/k/v and gate/up already fused in the checkpoint
(qkv_proj, gate_up_proj), LongRoPE scaling for its long-context variants (layers/rotary.py)
and, for the 4k models, a sliding window."""

from __future__ import annotations

from servelm.models.decoder import DecoderLM


class Phi3ForCausalLM(DecoderLM):
    family = "phi3"
    checkpoint_packed = ("qkv_proj", "gate_up_proj")  # loaded as they are (no rule)
