"""SpecController: how many draft tokens to ask for this step, from measured numbers.

Speculation turns spare memory bandwidth into tokens: at small batch a target step costs
about the same for 1 or k + 1 tokens per sequence, so each verified draft is nearly free. As
the batch grows the step turns compute-bound and its time grows with the tokens it scores;
past the break-even batch every rejected draft is paid for. The controller keeps three
online estimates and picks, each step, the k in 0..k_max with the highest expected tokens
per second for the current number of decodes B:

    per-token acceptance   a = accepted / tried   (a draft is tried if all before it passed)
    proposal rate          f = share of asked sequences the proposer gave drafts (n-gram
                                 finds no match for some)
    target step time       T(n) = c0 + c1 n        least squares over recent steps' tokens n
    draft time             D = r T(B) per draft step (r: measured draft/target ratio)

    rate(0) = B / T(B)
    rate(k) = B (1 - f + f E(a, k)) / (T(B (1 + f k)) + k D),   E = (1 - a^(k+1)) / (1 - a)

E is the planner's `expected_tokens_per_step` (servelm/planner/speculative.py). Until the
window holds steps of different sizes (T's slope unknown) it speculates with k_max, which is
also how it re-measures after a long run of steps of one size. Tensor-free: the simulator can
drive it.
"""

from __future__ import annotations

from collections import deque

from servelm.planner.speculative import expected_tokens_per_step


class SpecController:
    def __init__(self, k_max: int, adaptive: bool = True, window: int = 64,
                 prior_acceptance: float = 0.6, ema: float = 0.05):
        self.k_max = k_max
        self.adaptive = adaptive
        self.ema = ema
        self.acceptance = prior_acceptance
        self.proposal_rate = 1.0
        self.draft_ratio = 0.0  # one draft step / one target step at the same batch
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.last_k = k_max
        self.num_off_steps = 0  # steps where speculation was switched off (metrics)

    def eligible(self, seq) -> bool:
        from servelm.spec import eligible

        return eligible(seq)

    # -- decisions -------------------------------------------------------------------------

    def draft_len(self, num_decodes: int) -> int:
        k = self._best_k(num_decodes) if self.adaptive else self.k_max
        self.last_k = k
        if k == 0:
            self.num_off_steps += 1
        return k

    def _best_k(self, b: int) -> int:
        fit = self.step_time_model()
        if fit is None:
            return self.k_max  # explore: measure steps of another size
        c0, c1 = fit

        def t(n: float) -> float:
            return c0 + c1 * n

        best_k, best_rate = 0, b / t(b)
        a, f = self.acceptance, self.proposal_rate
        for k in range(1, self.k_max + 1):
            tokens = b * (1 - f + f * expected_tokens_per_step(a, k))
            rate = tokens / (t(b * (1 + f * k)) + k * self.draft_ratio * t(b))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def step_time_model(self) -> tuple[float, float] | None:
        """(c0, c1) of T(n) = c0 + c1 n by least squares, or None without spread in n."""
        if len(self._steps) < 4:
            return None
        n = [x for x, _ in self._steps]
        mean_n = sum(n) / len(n)
        var = sum((x - mean_n) ** 2 for x in n)
        if var < 1e-9 or max(n) < 1.5 * min(n):
            return None
        mean_t = sum(t for _, t in self._steps) / len(self._steps)
        c1 = sum((x - mean_n) * (t - mean_t) for x, t in self._steps) / var
        c1 = max(c1, 1e-9)
        c0 = max(mean_t - c1 * mean_n, 0.0)
        return c0, c1

    def break_even_batch(self, limit: int = 4096) -> int | None:
        """Smallest batch at which the current estimates switch speculation off."""
        if self.step_time_model() is None:
            return None
        for b in range(1, limit + 1):
            if self._best_k(b) == 0:
                return b
        return None

    # -- measurements ----------------------------------------------------------------------

    def observe_step(self, num_tokens: int, target_s: float) -> None:
        if num_tokens > 0 and target_s > 0:
            self._steps.append((num_tokens, target_s))

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
        fit = self.step_time_model()
        if fit is None or not num_asked or self.last_k <= 0:
            return
        target = fit[0] + fit[1] * num_asked
        if target > 0:
            ratio = draft_s / self.last_k / target
            self.draft_ratio += self.ema * (ratio - self.draft_ratio)

    def snapshot(self) -> dict:
        fit = self.step_time_model()
        return {"acceptance": self.acceptance, "proposal_rate": self.proposal_rate,
                "draft_ratio": self.draft_ratio, "last_k": self.last_k,
                "step_time_model": fit, "num_off_steps": self.num_off_steps}
