"""Verification rules: greedy keeps the target's argmax path; rejection sampling emits tokens
distributed exactly as the target's p, whatever the draft's q (chi-square bounds)."""

import pytest
import torch

from servelm.sampling.verify import accept_greedy, accept_sampled


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
