"""`servelm plan capacity`: concurrent users at a context length on N GPUs.

Owns: the memory budget per GPU (capacity x utilisation - activation reserve - weights per
GPU), the KV token pool, and users = pool / context, across TP x replicas, under tensor- or
data-parallel attention (deployment.py says what each holds); `memory_steps` is the same
chain for `plan kv` and `plan batch`.
Never: models time (decode.py); a user here holds a full context for its whole life.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from servelm.planner.chain import Chain, PlanResult
from servelm.planner.deployment import Deployment
from servelm.planner.errors import PlanInputError, require_positive
from servelm.planner.units import GB
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class CapacityPlan(PlanResult):
    command = "capacity"
    num_replicas: int
    weight_bytes_per_gpu: float
    kv_pool_bytes_per_gpu: float
    kv_tokens_per_replica: int
    kv_token_capacity: int
    users_per_replica: int
    max_concurrent_users: int
    # tensor parallel (tp > 1): the all-reduces of a decode step (servelm/planner/tp_comm.py)
    tp_allreduce_bytes_per_token_per_layer: float = 0.0
    tp_allreduce_s_per_step_batch_1: float = 0.0
    tp_allreduce_s_per_step_full: float = 0.0  # every user of a replica in one step


class ReplicaMemory(NamedTuple):
    weight_bytes_per_gpu: float
    kv_pool_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_tokens_per_replica: int


def _num_replicas(c: Chain, num_gpus: int, tp: int) -> int:
    if tp > num_gpus or num_gpus % tp:
        raise PlanInputError("--tp", f"{tp} must divide --num-gpus {num_gpus}")
    return int(c.add("num_replicas", "num_gpus / tp", f"{num_gpus} / {tp}", num_gpus // tp))


def _weights_per_gpu(c: Chain, d: Deployment) -> float:
    if not d.is_dp_attention:
        return c.add("weight_bytes_per_gpu", "total_params x bytes_per_param / tp",
                     f"{f(d.weight_bytes / d.bytes_per_param)} x {f(d.bytes_per_param)} / "
                     f"{d.tp}", d.weight_bytes_per_gpu, "B")
    m, bpp = d.model, d.bytes_per_param
    attn = c.add("attention_weight_bytes", "layers x attention_params_per_layer x "
                 "bytes_per_param (a whole copy on every GPU: data-parallel attention)",
                 f"{m.num_layers} x {f(d.attention_weight_bytes / m.num_layers / bpp)} x "
                 f"{f(bpp)}", d.attention_weight_bytes, "B")
    return c.add("weight_bytes_per_gpu", "attention_weight_bytes + (total_params x "
                 "bytes_per_param - attention_weight_bytes) / tp",
                 f"{f(attn)} + ({f(d.weight_bytes / bpp)} x {f(bpp)} - {f(attn)}) / {d.tp}",
                 d.weight_bytes_per_gpu, "B")


def _kv_per_token_per_gpu(c: Chain, d: Deployment) -> float:
    m = d.model
    if d.is_dp_attention:
        formula = ("kv_bytes_per_token (data-parallel attention: a token sits whole on the "
                   "one GPU that runs its request)")
        subst = f"{f(d.kv_bytes_per_token)}"
    elif m.is_mla:
        formula = "kv_bytes_per_token (MLA latent is replicated on every TP rank)"
        subst = f"{f(d.kv_bytes_per_token)}"
    else:
        formula = "kv_bytes_per_token / kv_shard, kv_shard = kv_heads / ceil(kv_heads / tp)"
        subst = f"{f(d.kv_bytes_per_token)} / {f(d.kv_shard)}"
    if not d.is_dp_attention and not m.is_mla and d.tp > m.num_kv_heads:
        c.note(f"tp {d.tp} > {m.num_kv_heads} KV heads: ranks hold duplicate heads.")
    if not d.is_dp_attention and m.is_mla and d.tp > 1:
        c.note(f"tensor-parallel MLA: each of the {d.tp} GPUs holds every token's latent, "
               "so the replica holds one GPU's worth of tokens; --attention-parallel dp "
               f"holds {d.tp} GPUs' worth.")
    return c.add("kv_bytes_per_token_per_gpu", formula, subst, d.kv_bytes_per_token_per_gpu,
                 "B")


def memory_steps(c: Chain, d: Deployment) -> ReplicaMemory:
    """usable -> weights per GPU -> KV pool per GPU -> KV bytes per token per GPU ->
    KV tokens per replica, as formula steps."""
    g = d.gpu
    usable = c.add("usable_bytes_per_gpu", "gpu_memory x mem_util - reserve",
                   f"{f(g.memory_bytes)} x {d.mem_util} - {f(d.reserve_gb * GB)}",
                   d.usable_bytes_per_gpu, "B")
    weights = _weights_per_gpu(c, d)
    pool = c.add("kv_pool_bytes_per_gpu", "usable_bytes_per_gpu - weight_bytes_per_gpu",
                 f"{f(usable)} - {f(weights)}", d.kv_pool_bytes_per_gpu, "B")
    if usable <= weights:
        c.note("the weight shard does not fit: raise --tp, use a smaller --weight-dtype or "
               "a larger GPU.")
    per_tok = _kv_per_token_per_gpu(c, d)
    if d.is_dp_attention:
        per_gpu = c.add("kv_tokens_per_gpu", "floor(kv_pool_bytes_per_gpu / "
                        "kv_bytes_per_token_per_gpu)", f"floor({f(pool)} / {f(per_tok)})",
                        d.kv_tokens_per_gpu, "tokens")
        tokens = c.add("kv_tokens_per_replica", "kv_tokens_per_gpu x tp (each GPU holds "
                       "different requests)", f"{f(per_gpu)} x {d.tp}",
                       d.kv_tokens_per_replica, "tokens")
    else:
        tokens = c.add("kv_tokens_per_replica", "floor(kv_pool_bytes_per_gpu / "
                       "kv_bytes_per_token_per_gpu)", f"floor({f(pool)} / {f(per_tok)})",
                       d.kv_tokens_per_replica, "tokens")
    return ReplicaMemory(weights, pool, per_tok, int(tokens))


def _users_per_replica(c: Chain, d: Deployment, context: int) -> int:
    if d.is_dp_attention:
        per_gpu = c.add("users_per_gpu", "floor(kv_tokens_per_gpu / context) (a request "
                        "cannot span GPUs)", f"floor({f(d.kv_tokens_per_gpu)} / {f(context)})",
                        d.kv_tokens_per_gpu // context, "users")
        return int(c.add("users_per_replica", "users_per_gpu x tp", f"{f(per_gpu)} x {d.tp}",
                         d.sequences_per_replica(context), "users"))
    return int(c.add("users_per_replica", "floor(kv_tokens_per_replica / context)",
                     f"floor({f(d.kv_tokens_per_replica)} / {f(context)})",
                     d.sequences_per_replica(context), "users"))


def plan_capacity(d: Deployment, num_gpus: int, context: int,
                  tp_latency_s: float | None = None) -> CapacityPlan:
    """tp_latency_s: one all-reduce's fixed cost (None: tp_comm's assumed default)."""
    require_positive("--num-gpus", num_gpus)
    require_positive("--context", context)
    c = Chain()
    replicas = _num_replicas(c, num_gpus, d.tp)
    mem = memory_steps(c, d)
    tokens = mem.kv_tokens_per_replica
    total = int(c.add("kv_token_capacity", "kv_tokens_per_replica x num_replicas",
                      f"{f(tokens)} x {replicas}", tokens * replicas, "tokens"))
    users = _users_per_replica(c, d, context)
    max_users = int(c.add("max_concurrent_users", "users_per_replica x num_replicas",
                          f"{users} x {replicas}", users * replicas, "users"))
    c.note("a user holds a full context; with shorter average lengths and paged KV, more fit.")
    comm = None
    if d.tp > 1:
        from servelm.planner.tp_comm import DEFAULT_LATENCY_S, tp_comm_steps

        comm = tp_comm_steps(c, d, max(1, users), DEFAULT_LATENCY_S if tp_latency_s is None
                             else tp_latency_s)
    return CapacityPlan(
        inputs={**d.inputs(), "num_gpus": num_gpus, "context": context,
                "mem_util": d.mem_util, "reserve_gb": d.reserve_gb},
        steps=tuple(c.steps), notes=tuple(c.notes),
        num_replicas=replicas, weight_bytes_per_gpu=mem.weight_bytes_per_gpu,
        kv_pool_bytes_per_gpu=mem.kv_pool_bytes_per_gpu, kv_tokens_per_replica=tokens,
        kv_token_capacity=total, users_per_replica=users, max_concurrent_users=max_users,
        **({} if comm is None else dict(
            tp_allreduce_bytes_per_token_per_layer=comm.bytes_per_token_per_layer,
            tp_allreduce_s_per_step_batch_1=comm.step_s_batch_1,
            tp_allreduce_s_per_step_full=comm.step_s_batch)),
    )
