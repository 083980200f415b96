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

Trees: the drafts are nodes 1..N of a tree whose root (node 0) is the token fed this step;
node i's parent is parents[i - 1] < i, and the target scored every node (p at node i: the
next-token distribution after the path root .. i). Greedy walks from the root, moving to the
child whose token is the target's argmax, and emits the argmax where no child has it: the
target's own greedy continuation again. Sampled: the children of a node are distinct point
masses (the drafter's top candidates), tried in order with recursive rejection: child x is
accepted with probability r(x) / sum(r), where r starts as p at the node; a rejected child's
mass is removed from r (r(x) = 0); when every child is rejected, the emitted token is drawn
from r. Trying x_1, x_2, .. this way draws from p exactly (P(x_2) = (1 - p(x_1)) p(x_2) /
(1 - p(x_1))), so each emitted token again follows the target. Since a rejected child's token
has r = 0, the token emitted after the path is never one of that node's children: the path
can be recovered from the emitted tokens alone.
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


def tree_children(parents: list[int]) -> list[list[int]]:
    """parents[i - 1] of node i (1..N) -> each node's children, in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, par in enumerate(parents, start=1):
        if not 0 <= par < i:
            raise ValueError(f"parents: node {i}'s parent must be in 0..{i - 1}, got {par}")
        children[par].append(i)
    return children


def accept_tree_greedy(tokens: list[int], parents: list[int],
                       target_argmax: list[int]) -> tuple[list[int], list[int]]:
    """tokens[i - 1], parents[i - 1]: node i's; target_argmax: N + 1 ids (root first) ->
    (emitted tokens, the accepted nodes from the root down)."""
    children = tree_children(parents)
    node, out, path = 0, [], []
    while True:
        want = target_argmax[node]
        out.append(want)
        nxt = next((c for c in children[node] if tokens[c - 1] == want), None)
        if nxt is None:
            return out, path
        path.append(nxt)
        node = nxt


def accept_tree_sampled(tokens: list[int], parents: list[int], p: torch.Tensor,
                        generator: torch.Generator | None = None
                        ) -> tuple[list[int], list[int]]:
    """p: [N + 1, V] target probabilities at each node (rows need not be normalised); the
    drafts are point masses -> (emitted tokens, accepted nodes)."""
    children = tree_children(parents)
    node, out, path = 0, [], []
    while True:
        residual = p[node].clone()
        nxt = None
        for c in children[node]:
            x = tokens[c - 1]
            total = float(residual.sum())
            u = float(torch.rand(1, generator=generator, device=p.device))
            if total > 0.0 and u * total < float(residual[x]):
                nxt = c
                break
            residual[x] = 0.0
        if nxt is None:
            if float(residual.sum()) <= 0.0:  # rounding left no mass: any draw from p
                residual = p[node]
            out.append(_draw(residual, generator))
            return out, path
        out.append(tokens[nxt - 1])
        path.append(nxt)
        node = nxt


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
