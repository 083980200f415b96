"""A 16-bit model's sampled logits, with the ones near each row's maximum recomputed in float32.

A bfloat16 head rounds every logit to 8 significant bits: at a logit of 25 one step is 0.125,
so two tokens a few hundredths apart in float32 can come out equal, and greedy decoding then
picks between them by token id, not by value. (The default model's answer to "What is the
capital of France?" turned on such a tie: 25.16 against 25.13 for the first token in float32
arithmetic on the same bfloat16 hidden state, 25.5 against 25.5 in bfloat16.)

`refine_near_max` recomputes, in float32, each logit within one bfloat16 step of its row's
maximum: a few dot products of the hidden row with the head's weight rows. Every other logit
is more than one step below the maximum, so its exact value is below the exact value of the
maximum's token and the refined argmax is the float32 argmax of the same hidden state.
Sampling at a temperature sees the same values for those tokens and the rounded ones for
the rest, as before.

`finish_logits` is the runner's way in: on the CPU one C++ pass a row
(cpu_kernels/logit_rows.cpp) makes the float32 logits, each row's argmax and the count of
logits within one step of the maximum, so only rows with a tie are recomputed and the sampler
can take the argmax it already has (servelm/sampling/sampler.py).

Owns: that refinement and finding the head's weight rows.
Never: touches float32 logits (a float32 model's, or a bfloat16 head on servelm's avx512_bf16
GEMM, which returns its float32 sums: layers/dot_linear.py, float_out) or a head whose rows are
not kept (a packed untied head: its oneDNN layout has no rows to read), which keeps plain
bfloat16 logits.
"""

from __future__ import annotations

import torch
from torch import nn

_REFINED = (torch.bfloat16, torch.float16)
_MAX_CANDIDATES = 4096  # a degenerate row (all logits equal) is left as it is


def head_rows(model: nn.Module) -> torch.Tensor | None:
    """The output head's weight [V, hidden] where it is kept in a 16-bit dtype, else None."""
    from servelm.layers.linear import PackedLinear

    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.dot_linear import DotLinear
    from servelm.quant.mixed_linear import MixedLinear

    head = getattr(model, "lm_head", "absent")
    if type(head) is MixedLinear and type(head.small) is AmxLinear:  # the same rows twice
        head = head.full
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if ((head is None or type(head) in (PackedLinear, DotLinear) and tied)  # a packed copy
            and type(getattr(model, "embed_tokens", None)) is nn.Embedding):
        weight = model.embed_tokens.weight  # (a vocabulary-parallel one holds a shard)
    elif type(head) is nn.Linear:
        weight = head.weight
    else:
        return None
    return weight if weight.dtype in _REFINED else None


def refine_near_max(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                    softcap: float | None = None) -> int:
    """logits [N, V] float32 (from hidden [N, H] through `weight`, rounded to 16 bits) is
    updated in place; returns how many logits were recomputed."""
    top = logits.max(dim=-1, keepdim=True).values
    # one bfloat16 step at the maximum's magnitude (float16 steps are finer: still covered)
    step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)
    near = logits >= top - step
    counts = near.sum(dim=-1)
    if int(counts.max()) <= 1 and int(counts.min()) == 1:
        return 0  # every row has one clear maximum: nothing to decide
    near &= (counts <= _MAX_CANDIDATES)[:, None]
    rows, cols = near.nonzero(as_tuple=True)
    exact = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
    if softcap:
        exact = torch.tanh(exact / softcap) * softcap
    logits[rows, cols] = exact
    return int(rows.numel())


def finish_logits(raw: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor | None,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 logits [N, V], each row's argmax or None) of the head's output `raw` [N, V]
    for `hidden` [N, H]. weight: the head's 16-bit rows (`head_rows`), whose near-maximum
    logits are recomputed; None: no refinement. The argmax comes with the CPU kernel (it is
    the refined logits' argmax); elsewhere it is None and the sampler computes it."""
    from servelm.layers.fused_cpu import fused_ops

    refine = weight is not None and raw.dtype in _REFINED
    ops = fused_ops(raw) if raw.dim() == 2 else None  # CPU float32 / bfloat16 rows
    if ops is None:
        logits = raw.float()
        if refine:
            refine_near_max(logits, hidden, weight, softcap)
        return logits, None
    logits, argmax, near = ops.logit_rows(raw.contiguous())
    if refine:
        tied = ((near > 1) & (near <= _MAX_CANDIDATES)).nonzero().flatten()
        if tied.numel():
            sub = logits[tied]
            refine_near_max(sub, hidden[tied], weight, softcap)
            logits[tied] = sub
            argmax[tied] = sub.argmax(dim=-1)
    return logits, argmax
