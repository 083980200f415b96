"""`servelm plan kv`: KV-cache bytes per token and per request, and the same model's cache
under other attention layouts (MHA, GQA, MQA, MLA) for comparison.

Owns: the kv formula chain and the layout comparison table.
Never: decides memory budgets (capacity.py) or TP sharding of the cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from servelm.config import ModelConfig
from servelm.cost import kv_bytes_per_token
from servelm.planner.chain import Chain, PlanResult
from servelm.planner.errors import require_positive
from servelm.planner.units import KV_DTYPES, KiB, dtype_bytes
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class KvPlan(PlanResult):
    command = "kv"
    table_key = "layouts"
    attention: str
    kv_bytes_per_token: float
    kv_bytes_per_request: float


def _gqa_heads(m: ModelConfig) -> int:
    # Llama-3's choice of 8 KV groups, or the largest divisor of the head count below it.
    if m.attention_kind == "GQA":
        return m.num_kv_heads
    return max(d for d in range(1, 9) if m.num_heads % d == 0)


def _layouts(m: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """The same layers/heads/head size under each layout. An MLA model's MHA counterpart
    caches per-head K of qk_head_dim and V of v_head_dim; a non-MLA model's MLA counterpart
    uses DeepSeek-V2's ratios (latent 4 x head_dim, rope key head_dim / 2)."""
    if m.is_mla:
        # Non-MLA views: per-head K/V of width (qk + v)/2 each gives the same element count.
        width = (m.qk_head_dim + m.value_head_dim) // 2
        base = dataclasses.replace(m, kv_lora_rank=0, head_dim=width)
        mla = m
    else:
        base = m
        mla = dataclasses.replace(m, kv_lora_rank=4 * m.head_dim,
                                  qk_rope_head_dim=m.head_dim // 2,
                                  qk_nope_head_dim=m.head_dim, v_head_dim=m.head_dim)
    return [
        ("MHA", dataclasses.replace(base, num_kv_heads=m.num_heads)),
        (f"GQA-{_gqa_heads(m)}", dataclasses.replace(base, num_kv_heads=_gqa_heads(m))),
        ("MQA", dataclasses.replace(base, num_kv_heads=1)),
        ("MLA", mla),
    ]


def _layout_rows(m: ModelConfig, nbytes: float, context: int, own: float) -> tuple[dict, ...]:
    rows = []
    for label, v in _layouts(m):
        per_tok = kv_bytes_per_token(v, nbytes)
        cached = (f"latent {v.kv_lora_rank} + rope {v.qk_rope_head_dim}" if v.is_mla
                  else f"2 x {v.num_kv_heads} heads x {v.head_dim}")
        is_model = v == m
        rows.append({
            "layout": label + (" (this model)" if is_model else ""),
            "cached_per_layer": cached,
            "kv_bytes_per_token": per_tok,
            "kib_per_token": round(per_tok / KiB, 2),
            "kv_bytes_per_request": per_tok * context,
            "vs_this_model": round(per_tok / own, 3),
        })
    return tuple(rows)


def plan_kv(m: ModelConfig, kv_dtype: str = "bf16", context: int = 8192) -> KvPlan:
    require_positive("--context", context)
    nbytes = dtype_bytes("--kv-dtype", kv_dtype, KV_DTYPES)
    c = Chain()
    if m.is_mla:
        per_layer = c.add("kv_elems_per_token_layer", "kv_lora_rank + qk_rope_head_dim",
                          f"{m.kv_lora_rank} + {m.qk_rope_head_dim}",
                          m.kv_lora_rank + m.qk_rope_head_dim, "elements")
        c.note("MLA caches one compressed latent (+ a shared rope key) per token per layer; "
               "K and V for all heads are re-projected from it.")
    else:
        per_layer = c.add("kv_elems_per_token_layer", "2 (K and V) x kv_heads x head_dim",
                          f"2 x {m.num_kv_heads} x {m.head_dim}",
                          2 * m.num_kv_heads * m.head_dim, "elements")
    per_tok = c.add("kv_bytes_per_token", "layers x kv_elems_per_token_layer x dtype_bytes",
                    f"{m.num_layers} x {f(per_layer)} x {f(nbytes)}",
                    m.num_layers * per_layer * nbytes, "B")
    per_req = c.add("kv_bytes_per_request", "kv_bytes_per_token x context",
                    f"{f(per_tok)} x {f(context)}", per_tok * context, "B")
    c.note(f"{f(per_tok / KiB)} KiB/token; a request's cache grows one token at a time up to "
           "this full-context size.")
    return KvPlan(
        inputs={"model": m.name, "attention": m.attention_kind, "kv_dtype": kv_dtype,
                "context": context},
        steps=tuple(c.steps), notes=tuple(c.notes),
        table=_layout_rows(m, nbytes, context, per_tok),
        attention=m.attention_kind, kv_bytes_per_token=per_tok, kv_bytes_per_request=per_req,
    )
