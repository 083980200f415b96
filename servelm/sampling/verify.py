"""Verification: which draft tokens the target accepts, and the token after them.

One sequence proposed drafts d_1..d_m; the target scored m + 1 positions in one step (its
distributions p_1..p_{m+1}, where p_i is the next-token distribution after d_1..d_{i-1}).

Greedy: accept the longest prefix with d_i == argmax p_i, then emit argmax p_{a+1}. The output
is the target's own greedy continuation, token for token.

Sampled (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a draw from the residual
norm(max(0, p_i - q_i)) and stop; if all m are accepted emit a draw from p_{m+1}. Each emitted
token is then distributed exactly as the target's p. A proposer with no distribution (n-gram)
is a point mass: q_i(d_i) = 1, so d_i is accepted with probability p_i(d_i) and the residual is
p_i with d_i removed.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """target_argmax: m + 1 ids -> the emitted tokens (accepted drafts + one more)."""
    out = []
    for d, t in zip(drafts, target_argmax):
        if d != t:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """p: [m + 1, V] target probabilities (rows need not be normalised); q: [m, V] draft
    probabilities, or None for a point-mass proposer -> the emitted tokens."""
    m = len(drafts)
    p = p / p.sum(dim=-1, keepdim=True)
    idx = torch.arange(m, device=p.device)
    d = torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_d = p[idx, d]
    if q is None:
        q_d = torch.ones_like(p_d)
    else:
        q = q / q.sum(dim=-1, keepdim=True)
        q_d = q[idx, d]
    u = torch.rand(m, generator=generator, device=p.device)
    # u < p/q, written so that q_d == 0 (a draft the draft could not have drawn) rejects.
    accept = (u * q_d < p_d).tolist()
    out = []
    for i, ok in enumerate(accept):
        if not ok:
            if q is None:
                residual = p[i].clone()
                residual[drafts[i]] = 0.0
            else:
                residual = (p[i] - q[i]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p
                residual = p[i]
            out.append(_draw(residual, generator))
            return out
        out.append(drafts[i])
    out.append(_draw(p[m], generator))
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
