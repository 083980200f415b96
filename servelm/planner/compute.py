"""Shared per-token arithmetic: KV bytes, FLOPs and weight bytes read per step.

Owns: the few formulas more than one subcommand uses, so kv, capacity, decode, prefill,
spec, disagg and offload all agree on them.
Never: builds a formula chain (the subcommand modules show the work).
"""

from __future__ import annotations

import math

from servelm.planner.hardware import Accelerator
from servelm.planner.models import ModelSpec, count_params, expected_experts_touched


def kv_elems_per_token_layer(m: ModelSpec) -> int:
    """Cached elements per token per layer: K and V heads, or MLA's latent + rope key."""
    if m.is_mla:
        return m.kv_lora_rank + m.qk_rope_head_dim
    return 2 * m.num_kv_heads * m.head_dim


def kv_bytes_per_token(m: ModelSpec, kv_dtype_bytes: float) -> float:
    return m.num_layers * kv_elems_per_token_layer(m) * kv_dtype_bytes


def kv_shard_factor(m: ModelSpec, tp: int) -> float:
    """How many ways tensor parallelism splits one token's KV across GPUs. KV heads are
    split across ranks but never below one head per rank (extra ranks hold replicas), and
    MLA's latent is shared by all heads, so every rank keeps the whole latent."""
    if m.is_mla:
        return 1.0
    heads_per_rank = math.ceil(m.num_kv_heads / tp)
    return m.num_kv_heads / heads_per_rank


def compute_dtype(weight_dtype: str, gpu: Accelerator) -> str:
    """FP8 weights run FP8 GEMMs where the GPU has them; everything else computes in bf16
    (int4/int8/GGUF are weight-only formats, dequantised to bf16 in the kernel)."""
    return "fp8" if weight_dtype == "fp8" and gpu.fp8_flops else "bf16"


def matmul_flops_per_token(m: ModelSpec) -> float:
    """2 FLOPs (multiply + add) per active matmul weight per token."""
    return 2.0 * count_params(m).matmul_active


def attention_flops_per_token(m: ModelSpec, context: float) -> float:
    """QK^T and PV for one query token against `context` cached tokens, all layers."""
    return 2.0 * m.num_layers * m.num_heads * (m.qk_head_dim + m.value_head_dim) * context


def prefill_attention_flops(m: ModelSpec, num_tokens: float, num_cached: float = 0) -> float:
    """Causal attention over a prompt: token i attends to num_cached + i + 1 tokens, so the
    sum is ~ n^2/2 + n*num_cached."""
    pairs = num_tokens * (num_tokens + 1) / 2 + num_tokens * num_cached
    return 2.0 * m.num_layers * m.num_heads * (m.qk_head_dim + m.value_head_dim) * pairs


def weight_bytes_read_per_step(m: ModelSpec, num_tokens: int, weight_bytes: float) -> float:
    """Weight bytes one forward step streams from HBM. Dense models read every matmul
    weight once per step. MoE layers read only the experts the step's tokens route to."""
    b = count_params(m)
    if not m.is_moe:
        return b.matmul_active * weight_bytes
    touched = expected_experts_touched(m, num_tokens)
    params = b.matmul_active + m.num_moe_layers * (touched - m.experts_per_token) * b.expert
    return params * weight_bytes
