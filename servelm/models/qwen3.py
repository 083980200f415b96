"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary (ModelConfig.qk_norm)."""

from servelm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
