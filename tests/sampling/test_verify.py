"""Verification rules: greedy keeps the target's argmax path; rejection sampling emits tokens
distributed exactly as the target's p, whatever the draft's q (chi-square bounds)."""

import pytest
import torch

from servelm.sampling.verify import (accept_greedy, accept_sampled, accept_tree_greedy,
                                      accept_tree_sampled)


def test_greedy_accepts_longest_matching_prefix():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all + bonus
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Pearson chi-square over the support against the 0.999 quantile (df <= 7 here)."""
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with p = 0 was emitted"
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    limit = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3}[df]
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit} (df {df}): {counts} vs {expected}"


P = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05, 0.00],
                  [0.05, 0.05, 0.10, 0.60, 0.10, 0.10],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.05, 0.05],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


@pytest.mark.parametrize("proposer", ["model", "point-mass"])
def test_rejection_sampling_preserves_target_distribution(proposer):
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)  # given the first emitted token was the first draft
    n_second = 0
    accepted = 0
    for _ in range(n):
        if proposer == "model":  # drafts drawn from q, as a draft model does
            d = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(2)]
            out = accept_sampled(d, P, Q, gen)
        else:  # n-gram: a fixed guess
            d = [1, 3]
            out = accept_sampled(d, P, None, gen)
        accepted += len(out) - 1
        first[out[0]] += 1
        if out[0] == d[0] and len(out) > 1:
            second[out[1]] += 1
            n_second += 1
    _chi2_ok(first, P[0], n)
    # After d1 is accepted, the next token follows p_2 (the target's distribution given d1).
    _chi2_ok(second, P[1], n_second)
    assert 0 < accepted < 2 * n  # both accept and reject happened


def test_rejection_of_a_draft_the_draft_could_not_draw():
    # q(d) = 0 (not from q) and p(d) = 0: always rejected, the residual is p.
    p = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.0, 0.5, 0.5]])
    for seed in range(20):
        assert accept_sampled([0], p, q, torch.Generator().manual_seed(seed))[0] == 1


# A tree over 6 tokens: root -> nodes 1 (token 1), 2 (token 0); node 1 -> 3 (token 3),
# 4 (token 2); node 2 -> 5 (token 4).
TREE_TOKENS = [1, 0, 3, 2, 4]
TREE_PARENTS = [0, 0, 1, 1, 2]


def test_tree_greedy_walks_the_targets_argmax_path():
    # argmax at root 0 -> node 2; at node 2 -> 4 -> node 5; at node 5 -> bonus 1
    argmax = [0, 5, 4, 5, 5, 1]
    assert accept_tree_greedy(TREE_TOKENS, TREE_PARENTS, argmax) == ([0, 4, 1], [2, 5])
    # argmax at node 1 is 2 -> node 4 (the second child), then the bonus 0
    assert accept_tree_greedy(TREE_TOKENS, TREE_PARENTS, [1, 2, 9, 9, 0, 9]) == \
        ([1, 2, 0], [1, 4])
    # no child matches at the root: only the target's token
    assert accept_tree_greedy(TREE_TOKENS, TREE_PARENTS, [5, 0, 0, 0, 0, 0]) == ([5], [])
    # a chain is a tree with parents 0, 1, 2: the chain rule's result
    chain = accept_tree_greedy([5, 6, 7], [0, 1, 2], [5, 6, 9, 1])
    assert chain == ([5, 6, 9], [1, 2]) and chain[0] == accept_greedy([5, 6, 7], [5, 6, 9, 1])


def test_tree_parents_must_come_before_their_children():
    with pytest.raises(ValueError, match="parents"):
        accept_tree_greedy([1, 2], [0, 2], [0, 0, 0])


TREE_P = torch.tensor([[0.35, 0.25, 0.15, 0.10, 0.10, 0.05],   # root
                       [0.05, 0.05, 0.30, 0.40, 0.10, 0.10],   # node 1
                       [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],   # node 2
                       [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],   # node 3
                       [0.60, 0.10, 0.10, 0.10, 0.05, 0.05],   # node 4
                       [0.20, 0.30, 0.10, 0.10, 0.20, 0.10]])  # node 5


def test_tree_rejection_sampling_preserves_target_distribution():
    """First token ~ p(root); after the first child (token 1) was accepted the second token
    ~ p(node 1), whichever of its children (or neither) it is."""
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first, second = torch.zeros(6), torch.zeros(6)
    n_second = accepted = 0
    for _ in range(n):
        out, path = accept_tree_sampled(TREE_TOKENS, TREE_PARENTS, TREE_P, gen)
        assert len(out) == len(path) + 1
        assert out[:-1] == [TREE_TOKENS[i - 1] for i in path]
        accepted += len(path)
        first[out[0]] += 1
        if out[0] == 1:
            second[out[1]] += 1
            n_second += 1
    _chi2_ok(first, TREE_P[0], n)
    _chi2_ok(second, TREE_P[1], n_second)
    assert 0 < accepted < 2 * n


def test_tree_sampling_never_emits_a_rejected_childs_token_after_the_path():
    """What lets the path be recovered from the emitted tokens."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        out, path = accept_tree_sampled(TREE_TOKENS, TREE_PARENTS, TREE_P, gen)
        node = path[-1] if path else 0
        kids = [TREE_TOKENS[c - 1] for c, par in enumerate(TREE_PARENTS, 1) if par == node]
        assert out[-1] not in kids
