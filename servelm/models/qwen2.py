"""Qwen2: the Llama decoder with biases on the q/k/v projections (set in ModelConfig)."""

from servelm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
