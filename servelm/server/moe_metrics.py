"""MoeMetrics: how a mixture-of-experts model spreads its tokens over its experts.

Owns: `servelm_moe_expert_tokens_total{layer, expert}` (tokens routed to each expert of each
MoE layer since start-up) and `servelm_moe_expert_load_imbalance{layer}` (the busiest
expert's tokens over the mean expert's: 1.0 is a perfectly even spread, num_experts /
experts_per_token the worst case of every token going to the same k). Fed by the runner's
snapshots (StepResult.expert_tokens every EXPERT_TOKENS_EVERY steps, passed on in the
engine's StepReport), registered on the server's own registry.
Never: touches the model; a dense model exports none of it.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class MoeMetrics:
    def __init__(self, registry):
        self.tokens = Counter("servelm_moe_expert_tokens_total",
                              "Tokens routed to each expert of each MoE layer",
                              ["layer", "expert"], registry=registry)
        self.imbalance = Gauge("servelm_moe_expert_load_imbalance",
                               "Busiest expert's routed tokens over the mean expert's, per MoE "
                               "layer (1.0: even)", ["layer"], registry=registry)
        self._last: list[list[int]] = []

    def observe_step(self, report) -> None:
        snapshot = report.moe_expert_tokens
        if not snapshot:
            return
        for layer, counts in enumerate(snapshot):
            last = self._last[layer] if layer < len(self._last) else [0] * len(counts)
            for expert, (now, before) in enumerate(zip(counts, last)):
                if now > before:
                    self.tokens.labels(str(layer), str(expert)).inc(now - before)
            total = sum(counts)
            if total:
                self.imbalance.labels(str(layer)).set(max(counts) * len(counts) / total)
        self._last = [list(c) for c in snapshot]


__all__ = ["MoeMetrics"]
