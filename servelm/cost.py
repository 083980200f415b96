"""What a model costs, from its ModelConfig: parameters, weight and KV bytes, bytes and FLOPs
of one forward step. The planner, the server's utilisation metrics and the benchmarks all
count with these functions, so they agree.

Owns: parameter counts (dense, MoE total and active, MLA attention), bytes per weight for a
quantization method as servelm's layers keep it, KV bytes per token (fp8 KV, MLA latent), and
the one definition of attention pairs:

    a span of n new tokens after c cached ones attends causally: query i sees c + i + 1 keys,
    so  pairs(c, n) = n * c + n * (n + 1) / 2      (decode: pairs(c, 1) = c + 1)

and of a step's cost given (num_tokens, num_context_tokens, num_attention_pairs):

    weight bytes  every layer weight once (MoE: the experts the step's tokens route to) + the
                  LM head; the input embedding is a row lookup and counts nothing
    KV bytes      kv_bytes_per_token x (num_context_tokens + num_tokens): each sequence reads
                  the keys it attends over (its context and new tokens) once and writes its
                  new tokens' keys; num_context_tokens = sum over sequences of c + n
    FLOPs         2 x layer matmul weights per token + 2 x vocab x hidden per token that goes
                  through the LM head + 2 x layers x heads x (qk_dim + v_dim) per pair

Never: imports torch or reads weights; every number comes from the shapes, so published totals
(Llama-3.1-70B ~70.6B, DeepSeek-V3 ~671B/37B) are checks rather than typed-in constants.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from servelm.config import ModelConfig

# Bytes per element of a float dtype, under the engine's and the planner's names.
FLOAT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_SCALE_BYTES = 4  # a float32 scale or zero (the CPU panels and GGUF blocks keep float32)


# ---------------------------------------------------------------- parameters


class ParamBreakdown(NamedTuple):
    """Parameter counts by part. `*_per_layer` are for one layer of that kind."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention_per_layer: int
    norms_per_layer: int
    dense_mlp_per_layer: int
    expert: int  # one routed expert
    shared_experts_per_layer: int
    router_per_layer: int
    final_norm: int
    total: int
    active: int  # touched by one token: all but the unchosen routed experts
    matmul_active: int  # active weights used as matmuls: no embedding lookup, + lm_head


def attention_params(m: ModelConfig) -> int:
    if m.is_mla:
        return _mla_attention_params(m)
    q = m.hidden_size * m.num_heads * m.head_dim
    kv = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * m.hidden_size
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.attention_bias else 0
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return q + kv + o + bias + qk_norm


def _mla_attention_params(m: ModelConfig) -> int:
    # Shapes follow DeepSeek-V3's modeling code: q_a/q_b low-rank query (or one q_proj),
    # kv_a_proj_with_mqa -> [latent | shared rope key], kv_b_proj latent -> per-head K_nope, V.
    h, n = m.hidden_size, m.num_heads
    if m.q_lora_rank:
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
    else:
        q = h * n * m.qk_head_dim
    kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # + its RMSNorm
    kv_b = m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
    o = n * m.v_head_dim * h
    return q + kv_a + kv_b + o


def count_params(m: ModelConfig) -> ParamBreakdown:
    """Parameters from the architecture (gated MLPs: gate, up and down projections).
    Memoized: pure in a frozen config, and a simulated step's cost asks for it every step."""
    try:
        return _count_params_cached(m)
    except TypeError:  # a config holding an unhashable value
        return _count_params(m)


@functools.lru_cache(maxsize=256)
def _count_params_cached(m: ModelConfig) -> ParamBreakdown:
    return _count_params(m)


def _count_params(m: ModelConfig) -> ParamBreakdown:
    embedding = m.vocab_size * m.hidden_size
    lm_head = 0 if m.tie_word_embeddings else embedding
    attn = attention_params(m)
    norms = (4 if m.sandwich_norms else 2) * m.hidden_size
    dense_mlp = 3 * m.hidden_size * m.intermediate_size
    expert = 3 * m.hidden_size * m.moe_intermediate_size if m.is_moe else 0
    shared = 3 * m.hidden_size * m.shared_expert_intermediate_size if m.is_moe else 0
    router = m.hidden_size * (m.num_experts + (1 if m.has_shared_expert_gate else 0))
    dense_layer = attn + norms + dense_mlp
    moe_common = attn + norms + shared + router
    total_layers = (m.num_dense_layers * dense_layer
                    + m.num_moe_layers * (moe_common + m.num_experts * expert))
    active_layers = (m.num_dense_layers * dense_layer
                     + m.num_moe_layers * (moe_common + m.num_experts_per_tok * expert))
    final_norm = m.hidden_size
    total = embedding + lm_head + total_layers + final_norm
    active = embedding + lm_head + active_layers + final_norm
    # The input embedding is a row lookup, not a matmul; a tied lm_head reuses the matrix.
    matmul_active = active_layers + embedding
    return ParamBreakdown(embedding, lm_head, attn, norms, dense_mlp, expert, shared, router,
                          final_norm, total, active, matmul_active)


def expected_experts_touched(m: ModelConfig, num_tokens: float) -> float:
    """Expected distinct routed experts one MoE layer reads for `num_tokens` tokens, if
    routing were uniform: E * (1 - (1 - k/E)^n). Real routers are skewed, so fewer."""
    if not m.is_moe:
        return 0.0
    e, k = m.num_experts, m.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** max(num_tokens, 0))


def layer_params_read(m: ModelConfig, num_tokens: float) -> float:
    """Layer parameters (attention, norms, MLPs) one step over `num_tokens` tokens reads:
    all of a dense model's; an MoE layer's fixed part plus the experts its tokens route to."""
    b = count_params(m)
    layers = b.matmul_active - b.embedding
    if not m.is_moe:
        return float(layers)
    touched = expected_experts_touched(m, num_tokens)
    return layers + m.num_moe_layers * (touched - m.num_experts_per_tok) * b.expert


# ---------------------------------------------------------------- bytes per weight


class WeightBytes(NamedTuple):
    """Bytes per parameter as the layers keep it: the layers' linears, the LM head, and the
    float parts (norms, embedding rows)."""

    linear: float
    lm_head: float
    other: float

    @classmethod
    def uniform(cls, nbytes: float) -> WeightBytes:
        return cls(nbytes, nbytes, nbytes)


def _int8_bytes(m: ModelConfig, group_size: int = 0) -> float:
    # codes + a float32 scale per group, or per row (about hidden_size inputs per row)
    return 1.0 + _SCALE_BYTES / (group_size or m.hidden_size)


def _int4_bytes(group_size: int, scale_bytes: int) -> float:
    return 0.5 + 2 * scale_bytes / group_size  # codes + (scale, zero) per group


def weight_bytes_per_param(m: ModelConfig, quantization: str | None,
                           dtype: str = "float32") -> WeightBytes:
    """Bytes per parameter under a servelm.quant method (None: float in `dtype`), as the
    layers hold them (servelm/quant/methods.py):

        int8         int8 codes + a float32 scale per row                      ~1 B
        int4[-gN]    4-bit codes + (scale, zero) in bf16 per N inputs (N = 32)  0.5 + 4/N B
        gguf         the file's Q4_0/Q4_1 as int4-g32 with float32 (scale, zero): 0.75 B;
                     Q8_0 as int8 with its float32 scale per 32: 1.125 B; other types int8
        fp8          e4m3 codes + a scale per row; the LM head stays float
    and the LM head, for every method but fp8, int8 (Int8Head; gguf: groups of 32)."""
    if dtype not in FLOAT_BYTES:
        raise ValueError(f"dtype must be one of {sorted(FLOAT_BYTES)}, got {dtype!r}")
    fl = float(FLOAT_BYTES[dtype])
    if quantization is None:
        return WeightBytes.uniform(fl)
    head = _int8_bytes(m)
    if quantization == "int8":
        linear = _int8_bytes(m)
    elif quantization.startswith("int4"):
        group = int(quantization.partition("-g")[2] or 32)
        linear = _int4_bytes(group, 2)
    elif quantization == "gguf":
        kind = m.gguf_weight_type
        linear = (_int4_bytes(32, _SCALE_BYTES) if kind in ("Q4_0", "Q4_1")
                  else _int8_bytes(m, 32) if kind == "Q8_0" else _int8_bytes(m))
        head = _int8_bytes(m, 32)
    elif quantization == "fp8":
        linear, head = _int8_bytes(m), fl
    else:
        raise ValueError(f"quantization {quantization!r} has no cost model")
    return WeightBytes(linear, head, fl)


def _as_weight_bytes(wb: WeightBytes | float) -> WeightBytes:
    return wb if isinstance(wb, WeightBytes) else WeightBytes.uniform(float(wb))


def weight_bytes_read_per_step(m: ModelConfig, num_tokens: float,
                               wb: WeightBytes | float) -> float:
    """Weight bytes one forward step streams: the layers (MoE: the experts touched) and the
    LM head. wb: bytes per parameter (a number: the same for every weight)."""
    wb = _as_weight_bytes(wb)
    b = count_params(m)
    norms = m.num_layers * b.norms_per_layer + b.final_norm
    linear = layer_params_read(m, num_tokens) - m.num_layers * b.norms_per_layer
    head = m.vocab_size * m.hidden_size
    if wb.linear == wb.lm_head == wb.other:  # keep a uniform count exact
        return (linear + norms + head) * wb.linear
    return linear * wb.linear + head * wb.lm_head + norms * wb.other


# ---------------------------------------------------------------- KV cache


def kv_elems_per_token_layer(m: ModelConfig) -> int:
    """Cached elements per token per layer: K and V heads, or MLA's latent + rope key
    (ModelConfig derives it, so config never imports cost)."""
    return m.kv_elems_per_token_layer


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str = "float32") -> float:
    """Bytes per cached element: "auto" stores the model's dtype, "fp8" one byte (its scales
    are per layer and KV head, nothing per token)."""
    if kv_cache_dtype == "fp8":
        return 1.0
    if kv_cache_dtype == "auto":
        return float(FLOAT_BYTES[dtype])
    return float(FLOAT_BYTES[kv_cache_dtype])


def kv_bytes_per_token(m: ModelConfig, dtype_bytes: float) -> float:
    """KV bytes one token occupies across all layers."""
    return m.num_layers * kv_elems_per_token_layer(m) * dtype_bytes


# ---------------------------------------------------------------- FLOPs and steps


def attention_pairs(num_context_tokens: float, num_new_tokens: float) -> float:
    """(query, key) pairs of n new tokens after c cached ones: n c + n (n + 1) / 2."""
    n, c = num_new_tokens, num_context_tokens
    if isinstance(n, int) and isinstance(c, int):
        return n * c + n * (n + 1) // 2  # exact: n (n + 1) is even
    return n * c + n * (n + 1) / 2


def attention_flops_per_pair(m: ModelConfig) -> float:
    """QK^T and PV for one (query, key) pair, all layers and heads."""
    return 2.0 * m.num_layers * m.num_heads * (m.qk_head_dim + m.value_head_dim)


def layer_matmul_flops_per_token(m: ModelConfig) -> float:
    """2 FLOPs (multiply + add) per active layer weight per token, without the LM head."""
    return 2.0 * layer_params_read(m, 1)


def lm_head_flops_per_token(m: ModelConfig) -> float:
    return 2.0 * m.vocab_size * m.hidden_size


def matmul_flops_per_token(m: ModelConfig) -> float:
    """2 FLOPs per active matmul weight per token, LM head included."""
    return layer_matmul_flops_per_token(m) + lm_head_flops_per_token(m)


class StepCost(NamedTuple):
    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def step_cost(m: ModelConfig, wb: WeightBytes | float, kv_bytes_per_tok: float,
              num_tokens: float, num_context_tokens: float, num_attention_pairs: float,
              num_logit_tokens: float | None = None) -> StepCost:
    """Bytes and FLOPs of one forward step (the module doc defines the terms).
    num_logit_tokens: tokens whose hidden state goes through the LM head (None: all)."""
    logits = num_tokens if num_logit_tokens is None else num_logit_tokens
    flops = (num_tokens * layer_matmul_flops_per_token(m)
             + logits * lm_head_flops_per_token(m)
             + num_attention_pairs * attention_flops_per_pair(m))
    return StepCost(weight_bytes_read_per_step(m, num_tokens, wb),
                    kv_bytes_per_tok * (num_context_tokens + num_tokens), float(flops))
