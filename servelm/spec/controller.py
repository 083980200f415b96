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

E is the planner's `expected_tokens_per_step` (servelm/planner/speculative.py). When the
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
        a, f = self.acceptance, self.proposal_rate
        for k in range(1, self.k_max + 1):
            tokens = b * (1 - f + f * expected_tokens_per_step(a, k))
            t_k = (cost.c0 + cost.decode * b * (1 - f) + cost.verify * b * f * (1 + k)
                   + k * self.draft_ratio * t_off)
            rate = tokens / max(t_k, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

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
        tried = accepted + (1 if accepted < proposed else 0)
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
            ratio = draft_s / self.last_k / target
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
