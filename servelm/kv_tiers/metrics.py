"""Prometheus metrics of the KV tiers below the device pool, per tier ("host", "disk"):
occupancy, blocks and bytes moved up (reload hits) and down (stored), evictions, failed
reads, measured bandwidth, and the reload / recompute decisions. They come from the
engine's StepReport.kv_tiers (cumulative counters as plain numbers, so they cross the
engine-core boundary like the rest of the report).

Owns: the collectors and the last counters seen. Never: imports torch, or reads a tier.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

# TierStats field -> (metric suffix, help); counters are cumulative in the report
_COUNTERS = {
    "num_hits": ("hit_blocks_total", "Blocks reloaded from the tier into the device pool"),
    "num_hit_bytes": ("reload_bytes_total", "Bytes moved up from the tier"),
    "num_stored": ("stored_blocks_total", "Blocks moved down into the tier"),
    "num_stored_bytes": ("stored_bytes_total", "Bytes moved down into the tier"),
    "num_evicted": ("evicted_blocks_total", "Blocks the tier dropped or moved further down"),
    "num_failed": ("failed_reads_total", "Reads missing or failing a check (recomputed)"),
}
_GAUGES = {
    "used_bytes": ("used_bytes", "Bytes the tier holds"),
    "capacity_bytes": ("capacity_bytes", "The tier's byte limit"),
    "num_blocks": ("blocks", "Blocks the tier holds"),
    "bandwidth_Bps": ("bandwidth_bytes_per_second", "Measured read bandwidth of the tier"),
}


class KVTierMetrics:
    def __init__(self, registry):
        r = registry
        self._counters = {k: Counter(f"servelm_kv_tier_{name}", doc, ["tier"], registry=r)
                          for k, (name, doc) in _COUNTERS.items()}
        self._gauges = {k: Gauge(f"servelm_kv_tier_{name}", doc, ["tier"], registry=r)
                        for k, (name, doc) in _GAUGES.items()}
        self.decisions = Counter("servelm_kv_tier_decisions_total",
                                 "Admissions with a prefix below the device pool, by decision",
                                 ["decision"], registry=r)
        self._seen: dict[tuple[str, str], float] = {}

    def _inc(self, counter, label: str, key: tuple[str, str], value: float) -> None:
        last = self._seen.get(key, 0.0)
        if value > last:
            counter.labels(label).inc(value - last)
            self._seen[key] = value

    def observe_report(self, kv_tiers: dict[str, dict[str, float]]) -> None:
        for tier, stats in kv_tiers.items():
            if tier == "decisions":
                for decision in ("reload", "recompute"):
                    self._inc(self.decisions, decision, ("decisions", decision),
                              stats.get(decision, 0))
                continue
            for k, counter in self._counters.items():
                self._inc(counter, tier, (tier, k), stats.get(k, 0))
            for k, gauge in self._gauges.items():
                gauge.labels(tier).set(stats.get(k, 0))


__all__ = ["KVTierMetrics"]
