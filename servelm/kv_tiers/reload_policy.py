"""Reload or recompute: the per-request decision for a prefix found below the device pool.

Owns: the recompute estimate (the step-cost model's prefill time for those tokens: given as
a StepCostModel file, or fitted on the fly from this engine's own measured steps), the
reload estimate (bytes per tier over that tier's measured bandwidth) and the decision with
its inputs (CacheExplain, what the request log and the timing header show). Never: moves a
block, or decides what is cached.

    reload_s    = sum over tiers  bytes(tier) / bandwidth(tier)
    recompute_s = per_prefill_token_s x n + per_prefill_pair_s x pairs(c, n)
                  (n tokens after c already in the pool; the marginal part of a step's
                   cost: the base and per-sequence terms are paid by the step anyway)
    reload  iff reload_s < recompute_s       (policy "cost"; "always" / "never" force it)

The same comparison `servelm plan offload` makes from datasheet figures (its crossover is
where the two are equal); here both sides are measured on this machine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from servelm.core.contract import StepDescription
from servelm.cost import attention_pairs
from servelm.engine.step_cost_model import StepCostModel, fit_cost_model, step_shape

RELOAD_POLICIES = ("cost", "always", "never")
_WINDOW = 512  # recent steps the on-the-fly fit uses
_REFIT_EVERY = 16  # steps between refits
_MIN_PREFILL_SAMPLES = 4  # prefill steps (of distinct sizes) before the fit is trusted


@dataclass
class CacheExplain:
    """Where one request's prefix came from, and why (the timing header's cache_explain)."""

    device_tokens: int = 0  # matched in the device pool's prefix cache
    host_tokens: int = 0  # found in host memory
    disk_tokens: int = 0  # found on disk
    decision: str = "none"  # "reload" | "recompute" | "none" (nothing below the pool)
    reload_bytes: int = 0
    reload_s: float = 0.0  # estimate
    recompute_s: float | None = None  # estimate; None: no prefill measured yet
    basis: str = ""  # what recompute_s came from
    loaded_tokens: int = 0  # tokens actually reloaded (less than found when a check failed)
    failed_blocks: int = 0  # blocks that failed a check or were missing: recomputed
    tiers: dict = field(default_factory=dict)  # per tier: bandwidth used (B/s)

    def to_dict(self) -> dict:
        out = {"device_tokens": self.device_tokens, "host_tokens": self.host_tokens,
               "disk_tokens": self.disk_tokens, "decision": self.decision,
               "reload_bytes": self.reload_bytes, "reload_s": round(self.reload_s, 6),
               "recompute_s": None if self.recompute_s is None else round(self.recompute_s, 6),
               "basis": self.basis, "loaded_tokens": self.loaded_tokens,
               "failed_blocks": self.failed_blocks}
        out.update({f"{k}_bandwidth_Bps": round(v) for k, v in self.tiers.items()})
        return out


class PrefillEstimate:
    """Marginal prefill seconds for n tokens after c, from a given model or this engine's
    own steps (refitted every _REFIT_EVERY steps over the last _WINDOW)."""

    def __init__(self, model: StepCostModel | None = None):
        self.model = model
        self.is_fixed = model is not None
        self._shapes: deque = deque(maxlen=_WINDOW)
        self._seconds: deque = deque(maxlen=_WINDOW)
        self._since_fit = 0

    @property
    def basis(self) -> str:
        if self.model is None:
            return "no prefill measured yet"
        return f"cost model {self.model.name!r}"

    def observe(self, step: StepDescription, step_s: float) -> None:
        if self.is_fixed or not step.seqs:
            return
        self._shapes.append(step_shape(step))
        self._seconds.append(step_s)
        self._since_fit += 1
        if self._since_fit >= _REFIT_EVERY:
            self._since_fit = 0
            self._refit()

    def _refit(self) -> None:
        sizes = {s.num_prefill_tokens for s in self._shapes if s.num_prefill_tokens}
        if len(sizes) < _MIN_PREFILL_SAMPLES:
            return
        model = fit_cost_model("measured on this engine", list(self._shapes),
                               list(self._seconds))
        if model.per_prefill_token_s > 0 or model.per_prefill_pair_s > 0:
            self.model = model

    def seconds(self, num_context: int, num_tokens: int) -> float | None:
        m = self.model
        if m is None:
            return None
        return (m.per_prefill_token_s * num_tokens
                + m.per_prefill_pair_s * attention_pairs(num_context, num_tokens))


def decide(policy: str, reload_s: float, recompute_s: float | None) -> str:
    if policy == "always":
        return "reload"
    if policy == "never":
        return "recompute"
    if recompute_s is None:  # nothing measured yet: a copy is cheaper than a forward
        return "reload"
    return "reload" if reload_s < recompute_s else "recompute"
