"""Prometheus metrics of a worker's KV transfers (prefill or decode role): transfers started,
finished and in flight, bytes, blocks and seconds moved, blocks not sent because the decode
worker held them, lease expiries, duplicate and late frames, and fallbacks by cause. They
come from the engine's StepReport.kv_transfer (TransferStats as plain cumulative numbers, so
they cross the engine-core boundary like the rest of the report).

Owns: the collectors and the last counters seen. Never: imports torch, or reads a transfer.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from servelm.disagg.transfer import FALLBACK_CAUSES

# TransferStats field -> (metric name, help); cumulative in the report
_COUNTERS = {
    "num_started": ("servelm_kv_transfers_started_total", "KV transfers begun"),
    "num_finished": ("servelm_kv_transfers_finished_total",
                     "KV transfers ended (any outcome); transfer_seconds_total over it is "
                     "the mean seconds per transfer"),
    "num_completed": ("servelm_kv_transfers_completed_total",
                      "KV transfers that moved every block asked for"),
    "num_bytes": ("servelm_kv_transfer_bytes_total",
                  "KV bytes sent (prefill) or received and kept (decode)"),
    "num_blocks": ("servelm_kv_transfer_blocks_total", "KV blocks sent or kept"),
    "transfer_s": ("servelm_kv_transfer_seconds_total",
                   "Seconds from a transfer's start to its end, summed"),
    "num_blocks_deduped": ("servelm_kv_transfer_deduped_blocks_total",
                           "Prompt blocks the decode worker held already (never sent)"),
    "num_lease_expiries": ("servelm_kv_transfer_lease_expiries_total",
                           "Transfers that ran out of their lease"),
    "num_duplicate_frames": ("servelm_kv_transfer_duplicate_frames_total",
                             "Frames received twice (ignored)"),
    "num_late_messages": ("servelm_kv_transfer_late_messages_total",
                          "Messages for a transfer that had ended (ignored)"),
}
_GAUGES = {
    "num_in_flight": ("servelm_kv_transfers_in_flight", "KV transfers in progress"),
    "last_bytes": ("servelm_kv_transfer_last_bytes", "Bytes of the last finished transfer"),
    "last_s": ("servelm_kv_transfer_last_seconds", "Seconds of the last finished transfer"),
}


class DisaggMetrics:
    def __init__(self, registry):
        self._counters = {k: Counter(name.removesuffix("_total"), doc, registry=registry)
                          for k, (name, doc) in _COUNTERS.items()}
        self._gauges = {k: Gauge(name, doc, registry=registry)
                        for k, (name, doc) in _GAUGES.items()}
        self.fallbacks = Counter("servelm_kv_transfer_fallbacks",
                                 "Transfers that ended without every block (decode: the rest "
                                 "computed here; prefill: cancelled / expired), by cause",
                                 ["cause"], registry=registry)
        for cause in FALLBACK_CAUSES:  # every cause on the page from the start, at 0
            self.fallbacks.labels(cause)
        self._seen: dict[str, float] = {}

    def _inc(self, counter, key: str, value: float) -> None:
        last = self._seen.get(key, 0.0)
        if value > last:
            counter.inc(value - last)
            self._seen[key] = value

    def observe_report(self, stats: dict[str, float]) -> None:
        for k, counter in self._counters.items():
            self._inc(counter, k, stats.get(k, 0.0))
        for k, gauge in self._gauges.items():
            gauge.set(stats.get(k, 0.0))
        for k, v in stats.items():
            if k.startswith("fallback:"):
                cause = k.split(":", 1)[1]
                self._inc(self.fallbacks.labels(cause), k, v)
