"""Roofline arithmetic for the GPU benchmark: the least time a step could take on this device.

Owns: bytes and FLOPs of a forward step from a ModelConfig and the step's spans (counted by
servelm.cost, as the planner and the server's metrics count them), and the ideal time given a
measured copy bandwidth and matmul rate. Never imports torch or measures:
it is pure arithmetic, so the CPU can check it.

Per step (spans: (context, new tokens, sampled?) per sequence; KV per token covers all layers):
    weight bytes  every linear weight once + the LM head (embedding rows read are negligible)
    KV bytes      each sequence reads its context + new keys once, writes its new keys
    FLOPs         2 * linear params per token + 2 * vocab * hidden per sampled token
                  + 4 * L * H * D per (query, key) pair, causal (query i of a span sees ctx+i+1)
    ideal time    max(FLOPs / matmul rate, bytes / copy bandwidth)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from servelm import cost
from servelm.config import ModelConfig


class ModelCosts(NamedTuple):
    weight_bytes: int  # read by every forward step
    linear_flops_per_token: int
    lm_head_flops_per_sample: int
    attn_flops_per_pair: int  # one (query, key) pair, all layers
    kv_bytes_per_token: int  # K and V of one token, all layers


class StepCost(NamedTuple):
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def num_params(c: ModelConfig) -> int:
    return cost.count_params(c).total


def model_costs(c: ModelConfig, dtype_bytes: int) -> ModelCosts:
    """The per-model numbers of servelm.cost (the planner and the server count the same)."""
    return ModelCosts(
        weight_bytes=int(cost.weight_bytes_read_per_step(c, 1, dtype_bytes)),
        linear_flops_per_token=int(cost.layer_matmul_flops_per_token(c)),
        lm_head_flops_per_sample=int(cost.lm_head_flops_per_token(c)),
        attn_flops_per_pair=int(cost.attention_flops_per_pair(c)),
        kv_bytes_per_token=int(cost.kv_bytes_per_token(c, dtype_bytes)))


def step_cost(costs: ModelCosts, spans: Iterable[tuple[int, int, bool]]) -> StepCost:
    """spans: (context tokens, new tokens, is_sampling) per scheduled sequence."""
    flops = kv_tokens = 0
    for ctx, n, sampled in spans:
        flops += (n * costs.linear_flops_per_token
                  + cost.attention_pairs(ctx, n) * costs.attn_flops_per_pair
                  + (costs.lm_head_flops_per_sample if sampled else 0))
        kv_tokens += ctx + 2 * n  # read context + new keys, write new keys
    return StepCost(float(flops), float(costs.weight_bytes),
                    float(kv_tokens * costs.kv_bytes_per_token))


def ideal_seconds(cost: StepCost, bandwidth: float, flops_rate: float) -> float:
    return max(cost.flops / flops_rate, cost.bytes / bandwidth)


def summarize(steps: Iterable[tuple[list[tuple[int, int, bool]], float]], costs: ModelCosts,
              bandwidth: float, flops_rate: float, elapsed_s: float) -> dict[str, float]:
    """Totals over recorded steps (spans, measured seconds) and the share of the roofline:
    the sum of each step's ideal time over the measured wall time of the whole run."""
    total = {"steps": 0, "flops": 0.0, "weight_bytes": 0.0, "kv_bytes": 0.0,
             "ideal_s": 0.0, "step_s": 0.0}
    for spans, seconds in steps:
        cost = step_cost(costs, spans)
        total["steps"] += 1
        total["flops"] += cost.flops
        total["weight_bytes"] += cost.weight_bytes
        total["kv_bytes"] += cost.kv_bytes
        total["ideal_s"] += ideal_seconds(cost, bandwidth, flops_rate)
        total["step_s"] += seconds
    total["elapsed_s"] = elapsed_s
    total["roofline_share"] = total["ideal_s"] / elapsed_s if elapsed_s > 0 else 0.0
    return total


def workload_bound(costs: ModelCosts, requests: Iterable[tuple[int, int]], bandwidth: float,
                   flops_rate: float) -> dict[str, float]:
    """A schedule-free lower bound on a whole offline run, for any system: every request
    (prompt tokens, output tokens) prefilled in one step and decoded one token per step, all
    requests at once, so the weights are read once per step of the longest request."""
    requests = list(requests)
    spans = []
    for num_in, num_out in requests:
        spans.append((0, num_in, True))
        spans += [(num_in + j, 1, True) for j in range(num_out - 1)]
    cost = step_cost(costs, spans)
    num_steps = 1 + max(num_out for _, num_out in requests) - 1
    weight_bytes = num_steps * costs.weight_bytes
    ideal = max(cost.flops / flops_rate, (weight_bytes + cost.kv_bytes) / bandwidth)
    return {"flops": cost.flops, "weight_bytes": float(weight_bytes), "kv_bytes": cost.kv_bytes,
            "ideal_s": ideal}
