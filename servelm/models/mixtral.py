"""Mixtral: the Llama decoder with every MLP a mixture of experts (top-k of E by softmax,
the k weights renormalised); also the base of the Qwen-MoE families (servelm/models/qwen_moe.py).
"""

from __future__ import annotations

from torch import nn

from servelm.config import ModelConfig
from servelm.layers.activation import act_and_mul
from servelm.layers.moe import MoE, RoutingConfig
from servelm.models.decoder import (WEIGHT_ONLY_METHODS, DecoderLM, GatedMLP, Placement,
                                    expert_rules, gate_up_rule, qkv_rule)
from servelm.models.packed import MOE_PACKED_MODULES


class MixtralForCausalLM(DecoderLM):
    family = "mixtral"
    # weight-only: attention, dense and shared MLPs, experts, head (decoder.py)
    quant_methods = WEIGHT_ONLY_METHODS
    packed_modules = MOE_PACKED_MODULES  # the dense layer's, and the experts' w1/w3 -> w13

    def routing(self, config: ModelConfig) -> RoutingConfig:
        groups = config.moe_topk_method != "greedy"
        return RoutingConfig(
            config.num_experts_per_tok, renormalize=config.norm_topk_prob,
            scoring="sigmoid" if config.moe_topk_method == "noaux_tc" else "softmax",
            num_groups=config.num_expert_groups if groups else 1,
            topk_groups=config.num_topk_groups if groups else 1,
            group_score="top2" if config.moe_topk_method == "noaux_tc" else "max",
            scaling=config.routed_scaling_factor)

    def make_mlp(self, config: ModelConfig, layer: int, quant) -> nn.Module:
        if layer < config.num_leading_dense_layers:
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant)
        shared = None
        if config.shared_expert_intermediate_size:
            shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                              config.hidden_act, quant)
        return MoE(config.hidden_size, config.num_experts, config.moe_intermediate_size,
                   self.routing(config), act_and_mul(config.hidden_act), shared,
                   has_shared_gate=config.has_shared_expert_gate,
                   has_score_bias=config.moe_topk_method == "noaux_tc")

    def weight_rules(self, config: ModelConfig) -> tuple:
        shared = config.shared_expert_intermediate_size
        return (
            qkv_rule(config, self.packed_modules),
            *expert_rules(self.packed_modules, config.moe_intermediate_size),
            gate_up_rule(self.packed_modules, "mlp.shared_expert", shared, "mlp.shared"),
            gate_up_rule(self.packed_modules, "mlp.shared_experts", shared, "mlp.shared"),
            (r"(.*)\.mlp\.shared_experts?\.down_proj\.weight",
             lambda m: Placement(f"{m[1]}.mlp.shared.down_proj.weight")),
            (r"(.*)\.mlp\.shared_expert_gate\.weight",
             lambda m: Placement(f"{m[1]}.mlp.shared_gate.weight")),
            gate_up_rule(self.packed_modules, "mlp", config.intermediate_size),
        )
