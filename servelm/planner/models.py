"""The planner's architecture record and parameter arithmetic.

Owns: ModelSpec (layers, widths, heads, MoE and MLA fields), loading it from an HF
config.json (dict, file or directory) or GGUF metadata, and counting parameters from the
architecture, so published totals (Llama-3.1-70B ~70.6B, DeepSeek-V3 ~671B/37B) are checks
rather than typed-in constants.
Never: loads weights or imports torch; gguf is imported only when a .gguf file is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from servelm.planner.errors import PlanInputError


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shape. MoE fields are 0 for dense models; MLA fields are 0
    for MHA/GQA models. `first_k_dense` leading layers use the dense MLP, the rest MoE."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # dense MLP width (also the first_k_dense layers of an MoE)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm weights on q and k (Qwen3)
    # MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # summed over all shared experts
    first_k_dense: int = 0
    # MLA (DeepSeek-V2/V3): K/V are re-projected from a cached latent of kv_lora_rank
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise PlanInputError("--model", f"{self.name}: {name} must be positive")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise PlanInputError("--model", f"{self.name}: experts_per_token out of range")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers


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


def attention_params(m: ModelSpec) -> int:
    if m.is_mla:
        return _mla_attention_params(m)
    q = m.hidden_size * m.num_heads * m.head_dim
    kv = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * m.hidden_size
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.attention_bias else 0
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return q + kv + o + bias + qk_norm


def _mla_attention_params(m: ModelSpec) -> int:
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


def count_params(m: ModelSpec) -> ParamBreakdown:
    """Parameters from the architecture (gated MLPs: gate, up and down projections)."""
    embedding = m.vocab_size * m.hidden_size
    lm_head = 0 if m.tie_word_embeddings else embedding
    attn = attention_params(m)
    norms = 2 * m.hidden_size
    dense_mlp = 3 * m.hidden_size * m.intermediate_size
    expert = 3 * m.hidden_size * m.moe_intermediate_size if m.is_moe else 0
    shared = 3 * m.hidden_size * m.shared_expert_intermediate_size if m.is_moe else 0
    router = m.hidden_size * m.num_experts
    dense_layer = attn + norms + dense_mlp
    moe_common = attn + norms + shared + router
    total_layers = (
        m.num_dense_layers * dense_layer
        + m.num_moe_layers * (moe_common + m.num_experts * expert)
    )
    active_layers = (
        m.num_dense_layers * dense_layer
        + m.num_moe_layers * (moe_common + m.experts_per_token * expert)
    )
    final_norm = m.hidden_size
    total = embedding + lm_head + total_layers + final_norm
    active = embedding + lm_head + active_layers + final_norm
    # The input embedding is a row lookup, not a matmul; a tied lm_head reuses the matrix.
    matmul_active = active_layers + embedding
    return ParamBreakdown(
        embedding, lm_head, attn, norms, dense_mlp, expert, shared, router,
        final_norm, total, active, matmul_active,
    )


def expected_experts_touched(m: ModelSpec, num_tokens: int) -> float:
    """Expected distinct routed experts one MoE layer reads for `num_tokens` tokens, if
    routing were uniform: E * (1 - (1 - k/E)^n). Real routers are skewed, so fewer."""
    if not m.is_moe:
        return 0.0
    e, k = m.num_experts, m.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** max(num_tokens, 0))


# ---------------------------------------------------------------- loaders


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def from_hf_config(cfg: dict[str, Any], name: str = "", source: str = "") -> ModelSpec:
    """Normalise an HF config.json dict (Llama, Qwen2/3, Mixtral, Qwen-MoE, DeepSeek-V2/V3,
    and multimodal wrappers that nest the LM under `text_config`)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", "")}
    try:
        return _spec_from_hf(cfg, name, source)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, PlanInputError):
            raise
        raise PlanInputError("--model", f"config.json is missing or has a bad field: {e}") from e


def _spec_from_hf(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    model_type = cfg.get("model_type", "")
    heads = int(_first(cfg, "num_attention_heads", "n_head"))
    hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
    num_experts = int(_first(cfg, "n_routed_experts", "num_local_experts", "num_experts",
                             default=0))
    moe_inter = int(_first(cfg, "moe_intermediate_size", default=0)) if num_experts else 0
    if num_experts and not moe_inter:  # Mixtral: experts use intermediate_size
        moe_inter = int(cfg["intermediate_size"])
    shared = int(_first(cfg, "shared_expert_intermediate_size", default=0))
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or model_type or "custom",
        num_layers=int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_first(cfg, "head_dim", default=hidden // heads)),
        vocab_size=int(cfg["vocab_size"]),
        intermediate_size=int(_first(cfg, "intermediate_size", "n_inner", default=4 * hidden)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        experts_per_token=int(_first(cfg, "num_experts_per_tok", default=0)) if num_experts else 0,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared,
        first_k_dense=int(_first(cfg, "first_k_dense_replace", default=0)) if num_experts else 0,
        kv_lora_rank=int(_first(cfg, "kv_lora_rank", default=0)),
        q_lora_rank=int(_first(cfg, "q_lora_rank", default=0)),
        qk_rope_head_dim=int(_first(cfg, "qk_rope_head_dim", default=0)),
        qk_nope_head_dim=int(_first(cfg, "qk_nope_head_dim", default=0)),
        v_head_dim=int(_first(cfg, "v_head_dim", default=0)),
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=0)),
        source=source,
    )


def load_hf_config(path: str | Path) -> ModelSpec:
    """A config.json file, or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanInputError("--model", f"cannot read {p}: {e}") from e
    return from_hf_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem,
                          source=str(p))
