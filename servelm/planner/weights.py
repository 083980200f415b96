"""`servelm plan weights`: parameter count (total, and active per token for MoE) and
bytes per dtype, computed from the architecture.

Owns: the weights formula chain and the bytes-per-dtype table.
Never: types in a published parameter count; every number comes from ModelConfig shapes
(servelm.cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.config import ModelConfig
from servelm.cost import ParamBreakdown, count_params
from servelm.planner.chain import Chain, PlanResult
from servelm.planner.units import DTYPE_BYTES, DTYPE_SOURCES, dtype_bytes
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class WeightsPlan(PlanResult):
    command = "weights"
    table_key = "bytes_by_dtype"
    total_params: int
    active_params: int
    weight_bytes: float
    active_weight_bytes: float


def _attention_formula(m: ModelConfig) -> tuple[str, str]:
    if m.is_mla:
        return ("q (low-rank) + kv_a + kv_b + o projections (MLA)",
                f"hidden {m.hidden_size}, heads {m.num_heads}, q_lora {m.q_lora_rank}, "
                f"kv_lora {m.kv_lora_rank}, qk {m.qk_head_dim}, v {m.v_head_dim}")
    bias = " + qkv bias" if m.attention_bias else ""
    norm = " + qk norms" if m.qk_norm else ""
    return (f"hidden x (2 x heads + 2 x kv_heads) x head_dim{bias}{norm}",
            f"{m.hidden_size} x (2 x {m.num_heads} + 2 x {m.num_kv_heads}) x {m.head_dim}")


def _layer_steps(c: Chain, m: ModelConfig, b: ParamBreakdown) -> None:
    c.add("embedding", "vocab x hidden", f"{m.vocab_size} x {m.hidden_size}",
          b.embedding, "params")
    if b.lm_head:
        c.add("lm_head", "vocab x hidden (untied)", f"{m.vocab_size} x {m.hidden_size}",
              b.lm_head, "params")
    formula, subst = _attention_formula(m)
    c.add("attention_per_layer", formula, subst, b.attention_per_layer, "params")
    if m.num_dense_layers:
        c.add("dense_mlp_per_layer", "3 (gate, up, down) x hidden x intermediate",
              f"3 x {m.hidden_size} x {m.intermediate_size}", b.dense_mlp_per_layer, "params")
    if m.is_moe:
        c.add("expert", "3 x hidden x moe_intermediate",
              f"3 x {m.hidden_size} x {m.moe_intermediate_size}", b.expert, "params")
        c.add("moe_fixed_per_layer", "shared experts (3 x hidden x shared_inter) + router "
              "(hidden x experts)", f"{f(b.shared_experts_per_layer)} + "
              f"{m.hidden_size} x {m.num_experts}",
              b.shared_experts_per_layer + b.router_per_layer, "params")


def _totals(c: Chain, m: ModelConfig, b: ParamBreakdown) -> None:
    dense_layer = b.attention_per_layer + b.norms_per_layer + b.dense_mlp_per_layer
    fixed = b.embedding + b.lm_head + b.final_norm
    common = (f"{f(fixed)} (embeddings + final norm) + {m.num_dense_layers} x {f(dense_layer)}"
              if m.num_dense_layers else f"{f(fixed)} (embeddings + final norm)")
    if not m.is_moe:
        c.add("total_params", "embeddings + layers x (attention + 2 norms + mlp)",
              common, b.total, "params")
        return
    moe_fixed = (b.attention_per_layer + b.norms_per_layer + b.shared_experts_per_layer
                 + b.router_per_layer)
    c.add("total_params", "embeddings + dense layers + moe_layers x (attention + norms + "
          "moe_fixed + experts x expert)",
          f"{common} + {m.num_moe_layers} x ({f(moe_fixed)} + {m.num_experts} x {f(b.expert)})",
          b.total, "params")
    c.add("active_params", "same, with experts_per_token routed experts per MoE layer",
          f"{common} + {m.num_moe_layers} x ({f(moe_fixed)} + {m.num_experts_per_tok} x "
          f"{f(b.expert)})", b.active, "params")


def plan_weights(m: ModelConfig, weight_dtype: str = "bf16") -> WeightsPlan:
    nbytes = dtype_bytes("--weight-dtype", weight_dtype)
    b = count_params(m)
    c = Chain()
    _layer_steps(c, m, b)
    _totals(c, m, b)
    weight_bytes = c.add("weight_bytes", "total_params x dtype_bytes",
                         f"{f(b.total)} x {f(nbytes)}", b.total * nbytes, "B")
    active_bytes = b.active * nbytes
    if m.is_moe:
        c.add("active_weight_bytes", "active_params x dtype_bytes",
              f"{f(b.active)} x {f(nbytes)}", active_bytes, "B")
        c.note("MoE: every expert must be resident; one token reads only the active ones, "
               "but a large batch touches most experts per step.")
    c.note(f"{weight_dtype}: {DTYPE_SOURCES[weight_dtype]}.")
    table = tuple(
        {"dtype": d, "bytes_per_param": round(DTYPE_BYTES[d], 4),
         "weight_bytes": b.total * DTYPE_BYTES[d],
         "weight_GB": round(b.total * DTYPE_BYTES[d] / 1e9, 2)}
        for d in ("fp32", "bf16", "fp8", "int4", "q8_0", "q4_k_m")
    )
    return WeightsPlan(
        inputs={"model": m.name, "weight_dtype": weight_dtype},
        steps=tuple(c.steps), notes=tuple(c.notes), table=table,
        total_params=b.total, active_params=b.active,
        weight_bytes=weight_bytes, active_weight_bytes=active_bytes,
    )
