"""Qwen2-MoE and Qwen3-MoE: many small experts, top-k by softmax, renormalised only where the
config says (norm_topk_prob). Qwen2-MoE adds q/k/v biases and an always-on shared expert
behind a sigmoid gate; Qwen3-MoE adds per-head q/k RMSNorms (ModelConfig.qk_norm)."""

from servelm.models.mixtral import MixtralForCausalLM


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    family = "qwen2_moe"


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    family = "qwen3_moe"
