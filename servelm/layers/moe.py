"""Mixture-of-experts MLP: a router, E gated experts stored as stacked tensors, and the
optional always-on shared experts around them.

Owns: routing (softmax or sigmoid scores, a correction bias, group-limited top-k,
renormalisation, a routed scaling factor: whatever the family's config says) and the expert
compute. Tokens are grouped by expert (one stable sort of the T*k assignments, then segments),
so each chosen expert runs one matmul over all of its tokens:

    assignments (token, expert):  (0,2) (0,5) (1,2) (1,0) (2,5) (2,2)     k = 2, T = 3
    sorted by expert:             e0: [1]   e2: [0, 1, 2]   e5: [0, 2]
    per expert: x[tokens] @ w13[e].T -> act_and_mul -> @ w2[e].T, times the routing weight,
    then index_add back into the token's row.

Never: reads the batch layout (it sees [T, hidden] rows only) or quantizes its experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from servelm.layers.activation import gate_up_silu, silu_and_mul


class RoutingConfig(NamedTuple):
    top_k: int
    renormalize: bool = True  # the chosen k weights sum to 1
    scoring: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    num_groups: int = 1  # experts split into groups; a token picks topk_groups of them first
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert ("max") or its best two ("top2")
    scaling: float = 1.0  # routed_scaling_factor, applied to the routed experts' sum


def route(logits: torch.Tensor, cfg: RoutingConfig,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, expert ids [T, k]).

    `bias` (DeepSeek-V3's e_score_correction_bias) changes which experts are chosen, never the
    weights they get."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if cfg.num_groups > 1:
        choice = _mask_groups(choice, cfg)
    ids = choice.topk(cfg.top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize and cfg.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring
                                                                   == "sigmoid" else 0.0))
    return weights * cfg.scaling, ids


def _mask_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """Keep the experts of each token's topk_groups best groups; the rest get 0 (scores are
    non-negative, so a masked expert is never chosen over a kept one)."""
    t, e = choice.shape
    grouped = choice.view(t, cfg.num_groups, e // cfg.num_groups)
    if cfg.group_score == "top2":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    keep = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
    return (grouped * mask.unsqueeze(-1)).view(t, e)


class Experts(nn.Module):
    """E gated MLPs: w13 [E, 2*I, hidden] holds [gate | up], w2 [E, hidden, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_and_mul):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.act_and_mul = act_and_mul
        # Tokens routed to each expert since the model was built: the expert load.
        self.register_buffer("num_routed_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)

    def quantize_experts(self, quant, blocks_of=None) -> None:
        """Each expert's two matrices as `quant`'s layers (int8 / int4 through servelm's
        quantized GEMMs); the float stacks are dropped. blocks_of(expert, "w13" | "w2"): a
        GGUF file's blocks for that matrix (--quantization gguf: kept as they are), or None
        to quantize the float values."""
        def build(e: int, which: str):
            blocks = blocks_of(e, which) if blocks_of is not None else None
            if blocks is not None:
                return quant.from_blocks(blocks, None)
            return quant.from_float(getattr(self, which).data[e], None)

        self.q13 = nn.ModuleList(build(e, "w13") for e in range(self.num_experts))
        self.q2 = nn.ModuleList(build(e, "w2") for e in range(self.num_experts))
        del self.w13, self.w2
        self.w13 = self.w2 = None

    def pack_experts(self, make) -> int:
        """Each expert's two float matrices as make(weight, None) layers (servelm's CPU GEMMs:
        layers/linear.py), in place of the stacks, which are dropped. Why: `x @ w[e].t()` on
        the unpacked stack read a few rows' weights at about half the rate of the dense
        layers' packed GEMMs, the most of a mixture's decode step. Returns how many layers."""
        if self.w13 is None:
            return 0
        self.q13 = nn.ModuleList(make(self.w13.data[e], None) for e in range(self.num_experts))
        self.q2 = nn.ModuleList(make(self.w2.data[e], None) for e in range(self.num_experts))
        del self.w13, self.w2
        self.w13 = self.w2 = None
        return 2 * self.num_experts

    def _expert(self, e: int, seg: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            if self.act_and_mul is silu_and_mul:  # as GatedMLP: a layer's fused form, if any
                return self.q2[e](gate_up_silu(self.q13[e], seg))
            return self.q2[e](self.act_and_mul(self.q13[e](seg)))
        return self.act_and_mul(seg @ self.w13[e].t()) @ self.w2[e].t()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k] -> sum_j weights[:, j] * expert_ids[:, j](x)."""
        if x.is_cuda and self.w13 is not None:  # the Triton grouped GEMMs
            from servelm.kernels.fused_moe import Segments, fused_moe

            seg = Segments(ids, self.num_experts)
            self.num_routed_tokens += seg.counts
            return fused_moe(x, self.w13, self.w2, weights, ids, self.act_and_mul, seg)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.num_routed_tokens += counts
        rows = x.index_select(0, token_of)  # [T*k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start:start + n] = self._expert(e, rows[start:start + n])
                start += n
        out = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, optionally behind a sigmoid gate)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 routing: RoutingConfig, act_and_mul, shared: nn.Module | None = None,
                 has_shared_gate: bool = False, has_score_bias: bool = False):
        super().__init__()
        self.routing = routing
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.requires_grad_(False)
        # DeepSeek-V3's e_score_correction_bias: a buffer, as transformers keeps it (it is
        # fitted outside training, and not counted as a parameter).
        self.register_buffer("score_bias", torch.zeros(num_experts) if has_score_bias
                             else None)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act_and_mul)
        self.shared = shared
        self.shared_gate = None
        if has_shared_gate:
            self.shared_gate = nn.Linear(hidden_size, 1, bias=False)
            self.shared_gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        weights, ids = route(self.gate(x), self.routing, self.score_bias)  # [T, k]
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out
