"""SpecController: how many draft tokens to ask for this step, from measured numbers.

Speculation turns spare memory bandwidth into tokens: at small batch a target step costs
about the same for 1 or k + 1 tokens per sequence, so each verified draft is nearly free. As
the batch grows the step turns compute-bound and its time grows with the tokens it scores;
past the break-even batch every rejected draft is paid for. The controller keeps online
estimates and picks, each step, the k in 0..k_max with the highest expected tokens per
second for the current number of decodes B:

    per-token acceptance   a = accepted / tried   (a draft is tried if all before it passed)
    proposal rate          f = share of asked sequences the proposer gave drafts (n-gram
                                 finds no match for some)
    target step time       T = c0 + cd n_decode + cv n_verify + cp n_prefill
                                 least squares over the last 64 steps: a token scored in a
                                 verification costs what it measurably costs (on the CPU a
                                 (k+1)-token query is attended like a prefill chunk, several
                                 times a decode token), not what a decode token costs
    draft time             r T_off per draft step (r: measured draft/target ratio)

    T_off = c0 + cd B                       rate(0) = B / T_off
    T_k   = c0 + cd B (1 - f) + cv B f (1 + k) + k r T_off
    rate(k) = B (1 - f + f E(a, k)) / T_k,   E = (1 - a^(k+1)) / (1 - a)

E is the planner's `expected_tokens_per_step` (servelm/planner/speculative.py). Trees
(TreeSpecController) choose their node budget the same way, with their measured accepted
length per size in place of E and a depth's drafter step in place of a position's. When the
window cannot tell a verification token's cost (no verifying step in it) the controller
drafts k_max for a step; when it cannot tell a plain decode's (no plain decodes in it) it runs
one step without drafts: one probe per window at most, so a decision is re-measured as the
batch and the traffic change. Tensor-free (numpy only): the simulator can drive it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from servelm.planner.speculative import expected_tokens_per_step


@dataclass(frozen=True)
class StepCost:
    """T = c0 + decode n_decode + verify n_verify + prefill n_prefill (seconds)."""

    c0: float
    decode: float
    verify: float
    prefill: float

    def off(self, b: float) -> float:
        return self.c0 + self.decode * b


class SpecController:
    def __init__(self, k_max: int, adaptive: bool = True, window: int = 64,
                 prior_acceptance: float = 0.6, ema: float = 0.05):
        self.k_max = k_max
        self.adaptive = adaptive
        self.ema = ema
        self.acceptance = prior_acceptance
        self.proposal_rate = 1.0
        self.draft_ratio = 0.0  # one draft step / one target step at the same batch
        self._draft_measured = False
        self._steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.last_k = k_max
        self.num_off_steps = 0  # steps where speculation was switched off (metrics)
        self.num_probes = 0

    def eligible(self, seq) -> bool:
        from servelm.spec import eligible

        return eligible(seq)

    # -- decisions -------------------------------------------------------------------------

    def draft_len(self, num_decodes: int) -> int:
        k = self._decide(num_decodes) if self.adaptive else self.k_max
        self.last_k = k
        if k == 0:
            self.num_off_steps += 1
        return k

    def _decide(self, b: int) -> int:
        if not any(v for _, v, _, _ in self._steps):
            return self.k_max  # explore: what does a verifying step cost?
        if not any(d for d, _, _, _ in self._steps):
            self.num_probes += 1
            return 0  # probe: what does a plain decode cost?
        return self._best_k(b)

    def _best_k(self, b: int) -> int:
        cost = self.step_time_model()
        if cost is None:
            return self.k_max
        t_off = max(cost.off(b), 1e-9)
        best_k, best_rate = 0, b / t_off
        f = self.proposal_rate
        for k in range(1, self.k_max + 1):
            tokens = b * (1 - f + f * (1 + self.expected_accepted(k)))
            t_k = (cost.c0 + cost.decode * b * (1 - f) + cost.verify * b * f * (1 + k)
                   + self.draft_steps(k) * self.draft_ratio * t_off)
            rate = tokens / max(t_k, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def expected_accepted(self, k: int) -> float:
        """Drafts accepted per verification with k drafts: a chain's E(a, k) - 1."""
        return expected_tokens_per_step(self.acceptance, k) - 1.0

    def draft_steps(self, k: int) -> int:
        """Proposer steps k drafts cost: one per chain position."""
        return k

    def step_time_model(self) -> StepCost | None:
        """Least squares of step time on (1, decode, verify, prefill tokens) over the window;
        None until it holds both verifying and plain-decode steps. A feature that never
        varies folds into c0 (rank-deficient systems take the minimum-norm solution, which
        still reproduces the step shapes that were measured)."""
        if len(self._steps) < 4:
            return None
        rows = np.array(self._steps, dtype=np.float64)
        x, t = rows[:, :3], rows[:, 3]
        if not x[:, 0].any() or not x[:, 1].any():
            return None
        a = np.hstack([np.ones((len(rows), 1)), x])
        scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
        coef, *_ = np.linalg.lstsq(a / scale, t, rcond=None)
        c = np.maximum(coef / scale, 0.0)
        return StepCost(float(c[0]), float(c[1]), float(c[2]), float(c[3]))

    def break_even_batch(self, limit: int = 4096) -> int | None:
        """Smallest batch at which the current estimates switch speculation off."""
        if self.step_time_model() is None:
            return None
        for b in range(1, limit + 1):
            if self._best_k(b) == 0:
                return b
        return None

    # -- measurements ----------------------------------------------------------------------

    def observe_step(self, target_s: float, decode: int = 0, verify: int = 0,
                     prefill: int = 0) -> None:
        """One step's target time and its tokens: plain decodes, tokens scored by
        verifications (1 + drafts per sequence), prompt tokens."""
        if target_s > 0 and decode + verify + prefill > 0:
            self._steps.append((decode, verify, prefill, target_s))

    def observe_verify(self, proposed: int, accepted: int) -> None:
        """One sequence's verification: `accepted` of `proposed` drafts passed."""
        tried = accepted + (1 if accepted < self.draft_steps(proposed) else 0)
        if tried:
            sample = accepted / tried
            # Weight by trials, so long verifications count for more.
            w = min(1.0, self.ema * tried)
            self.acceptance += w * (sample - self.acceptance)

    def observe_draft(self, num_asked: int, draft_s: float, step_s: float,
                      num_proposed_seqs: int | None = None) -> None:
        if num_proposed_seqs is not None and num_asked:
            self.proposal_rate += self.ema * (num_proposed_seqs / num_asked
                                              - self.proposal_rate)
        cost = self.step_time_model()
        if cost is None or not num_asked or self.last_k <= 0:
            return
        target = cost.off(num_asked)
        if target > 0:
            ratio = draft_s / self.draft_steps(self.last_k) / target
            if not self._draft_measured:  # the first measurement replaces the prior (0)
                self.draft_ratio, self._draft_measured = ratio, True
            else:  # a draft model's cost moves with the batch: follow it quickly
                self.draft_ratio += 0.25 * (ratio - self.draft_ratio)

    def snapshot(self) -> dict:
        cost = self.step_time_model()
        return {"acceptance": self.acceptance, "proposal_rate": self.proposal_rate,
                "draft_ratio": self.draft_ratio, "last_k": self.last_k,
                "step_cost": None if cost is None else dataclasses.asdict(cost),
                "num_off_steps": self.num_off_steps, "num_probes": self.num_probes}


class TreeSpecController(SpecController):
    """The same choice for tree drafting (servelm/spec/tree.py): k is the tree's node
    budget, and the tree's depth is `depth_for(k)`, so choosing the size chooses the depth.

        accepted  L(k) = the measured mean accepted drafts of trees of k nodes (an EMA, once
                         `min_samples` verifications used k), else sum_{i=1..D(k)} a^i with a
                         the per-depth acceptance measured on trees (a chain of D(k) tried
                         positions), never below a smaller size's measured L
        draft     D(k) drafter steps (one per depth: a depth's nodes run as one step)
        verify    1 + k tokens per sequence, at the fitted cost of a verification token

    and rate(k) = B (1 - f + f (1 + L(k))) / T_k as for a chain; k = 0 (off) wins where no
    tree pays. A bigger tree only pays where its extra nodes' acceptance beats their
    verification cost, which the fitted per-token cost prices at every batch size."""

    def __init__(self, k_max: int, adaptive: bool = True, depth_for=None,
                 min_samples: int = 8, **kw):
        super().__init__(k_max, adaptive, **kw)
        self.depth_for = depth_for or (lambda k: k)
        self.min_samples = min_samples
        self._len = np.zeros(k_max + 1)  # EMA of accepted drafts per tree size
        self._len_n = np.zeros(k_max + 1, dtype=np.int64)

    def draft_steps(self, k: int) -> int:
        return self.depth_for(k) if k > 0 else 0

    def expected_accepted(self, k: int) -> float:
        prior = sum(self.acceptance ** i for i in range(1, self.draft_steps(k) + 1))
        measured = [self._len[j] for j in range(1, k) if self._len_n[j] >= self.min_samples]
        if self._len_n[k] >= self.min_samples:
            return float(self._len[k])
        return max([prior] + measured)

    def observe_verify(self, proposed: int, accepted: int) -> None:
        super().observe_verify(proposed, accepted)
        if 0 < proposed <= self.k_max:
            n = self._len_n[proposed] = self._len_n[proposed] + 1
            w = max(1.0 / n, self.ema)
            self._len[proposed] += w * (accepted - self._len[proposed])

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["tree_accepted"] = {int(k): float(self._len[k])
                                for k in np.nonzero(self._len_n)[0]}
        return out
