"""`servelm plan kv`: KV-cache bytes per token and per request, and the same model's cache
under other attention layouts (MHA, GQA, MQA, MLA) for comparison.

Owns: the kv formula chain, the layout comparison table, and what tensor- or data-parallel
attention over `tp` GPUs makes of one token's cache (bytes per GPU, copies per replica);
given a Deployment, the replica's KV token pool too (capacity.memory_steps).
Never: decides memory budgets itself (capacity.py does) or times anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from servelm.config import ModelConfig
from servelm.cost import kv_bytes_per_token
from servelm.planner.capacity import memory_steps
from servelm.planner.chain import Chain, PlanResult
from servelm.planner.deployment import Deployment, kv_split, resolve_attention_parallel
from servelm.planner.errors import PlanInputError, require_positive
from servelm.planner.units import KV_DTYPES, KiB, dtype_bytes
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class KvPlan(PlanResult):
    command = "kv"
    table_key = "layouts"
    attention: str
    kv_bytes_per_token: float
    kv_bytes_per_request: float
    kv_bytes_per_token_per_gpu: float
    kv_copies: float
    replica_kv_bytes_per_token: float
    kv_tokens_per_replica: int | None  # with a GPU (--gpu) only


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


def _split_steps(c: Chain, m: ModelConfig, per_tok: float, tp: int, ap: str,
                 show_per_gpu: bool) -> None:
    """What `tp` GPUs under tp or dp attention make of one token's cache. With a GPU,
    capacity.memory_steps shows kv_bytes_per_token_per_gpu instead."""
    shard, copies = kv_split(m, tp, ap)
    if ap == "dp":
        c.add("kv_shard", "1 (data-parallel attention: the token sits whole on its request's "
              "GPU)", "", shard, "ways")
    else:
        c.add("kv_shard", "1 (MLA's one latent is read by every head)" if m.is_mla else
              "kv_heads / ceil(kv_heads / tp)", "" if m.is_mla else
              f"{m.num_kv_heads} / ceil({m.num_kv_heads} / {tp})", shard, "ways")
    if show_per_gpu:
        c.add("kv_bytes_per_token_per_gpu", "kv_bytes_per_token / kv_shard (on each GPU that "
              "holds the token)", f"{f(per_tok)} / {f(shard)}", per_tok / shard, "B")
    if ap == "dp":
        c.add("kv_copies", "1 (the other GPUs hold other requests)", "", copies, "copies")
    else:
        c.add("kv_copies", "tp (every rank holds the whole latent)" if m.is_mla else
              "tp / kv_shard (ranks beyond kv_heads hold duplicates)", f"{tp} / {f(shard)}",
              copies, "copies")
    c.add("replica_kv_bytes_per_token", "kv_bytes_per_token x kv_copies (HBM the replica "
          "spends per cached token)", f"{f(per_tok)} x {f(copies)}", per_tok * copies, "B")


def plan_kv(m: ModelConfig, kv_dtype: str = "bf16", context: int = 8192, *, tp: int = 1,
            attention_parallel: str | None = None,
            cards: Deployment | None = None) -> KvPlan:
    """cards: a Deployment of this model; its tp, attention split and KV dtype are used,
    and the chain goes on to the weights per GPU and the replica's KV token pool."""
    require_positive("--context", context)
    if cards is not None:
        if cards.model != m:
            raise PlanInputError("--model", "the deployment is of another model")
        kv_dtype, tp, attention_parallel = cards.kv_dtype, cards.tp, cards.attention_parallel
    require_positive("--tp", tp)
    ap = resolve_attention_parallel(m, attention_parallel)
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
    shard, copies = kv_split(m, tp, ap)
    per_gpu, replica = per_tok / shard, per_tok * copies
    if tp > 1 or cards is not None:
        _split_steps(c, m, per_tok, tp, ap, show_per_gpu=cards is None)
    tokens = memory_steps(c, cards).kv_tokens_per_replica if cards is not None else None
    c.note(f"{f(per_tok / KiB)} KiB/token; a request's cache grows one token at a time up to "
           "this full-context size.")
    inputs = {"model": m.name, "attention": m.attention_kind, "kv_dtype": kv_dtype,
              "context": context}
    if tp > 1 or cards is not None:
        inputs |= {"tp": tp, "attention_parallel": ap}
    if cards is not None:
        inputs |= {"gpu": cards.gpu.name, "weight_dtype": cards.weight_dtype}
    return KvPlan(
        inputs=inputs, steps=tuple(c.steps), notes=tuple(c.notes),
        table=_layout_rows(m, nbytes, context, per_tok),
        attention=m.attention_kind, kv_bytes_per_token=per_tok, kv_bytes_per_request=per_req,
        kv_bytes_per_token_per_gpu=per_gpu, kv_copies=copies,
        replica_kv_bytes_per_token=replica, kv_tokens_per_replica=tokens,
    )
