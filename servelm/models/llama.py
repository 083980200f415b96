"""Llama (Llama 2/3/3.1, Mistral, SmolLM2), Qwen2 and Qwen3: the decoder frame as it is.

Every difference between them is configuration (servelm/config/model.py ModelConfig): Qwen2's
biases on q/k/v (attention_bias), Qwen3's per-head RMSNorm on q and k before rotary
(qk_norm), Mistral's sliding window (sliding_window: a layer that slides asks the attention
backend for the window once a sequence in the step is longer than it), the rope scaling.
Every quantization method takes them.
"""

from __future__ import annotations

from servelm.models.decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    family = "llama"
    quant_methods = None  # every method (servelm/quant)


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"
