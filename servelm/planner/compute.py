"""The planner's per-token arithmetic, over servelm.cost (the one cost model the planner,
the server's metrics and the benchmarks share).

Owns: what only the planner asks: how TP shards the KV cache, which dtype the GEMMs run in,
and attention FLOPs phrased per query token against a context.
Never: builds a formula chain (the subcommand modules show the work), or counts anything
servelm.cost counts.
"""

from __future__ import annotations

import math

from servelm.config import ModelConfig
from servelm.cost import (  # noqa: F401 - the planner's names for the shared formulas
    attention_flops_per_pair,
    attention_pairs,
    kv_bytes_per_token,
    kv_elems_per_token_layer,
    matmul_flops_per_token,
    weight_bytes_read_per_step,
)
from servelm.planner.hardware import Accelerator


def kv_shard_factor(m: ModelConfig, tp: int) -> float:
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


def attention_flops_per_token(m: ModelConfig, context: float) -> float:
    """QK^T and PV for one query token against `context` keys, all layers."""
    return attention_flops_per_pair(m) * context


def prefill_attention_flops(m: ModelConfig, num_tokens: float, num_cached: float = 0) -> float:
    """Causal attention over a prompt: attention_pairs(num_cached, num_tokens) pairs."""
    return attention_flops_per_pair(m) * attention_pairs(num_cached, num_tokens)
