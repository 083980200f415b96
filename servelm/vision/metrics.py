"""Prometheus metrics of the vision path: images per request, encoder time, images encoded
and encoder cache hits (the last three from the engine's StepReport counters, which cross the
engine-core boundary as plain numbers).

Owns: the collectors and the last counters seen. Never: imports torch.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram


class VisionMetrics:
    def __init__(self, registry):
        r = registry
        self.images_per_request = Histogram(
            "servelm_request_images", "Images in a chat request that carries any",
            registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16))
        self.images_encoded = Counter("servelm_encoder_images_total",
                                      "Images run through the vision encoder", registry=r)
        self.cache_hits = Counter("servelm_encoder_cache_hits_total",
                                  "Images whose embeddings came from the encoder cache",
                                  registry=r)
        self.encoder_seconds = Counter("servelm_encoder_seconds_total",
                                       "Seconds the vision encoder ran", registry=r)
        self._seen = (0, 0, 0.0)

    def observe_images(self, num_images: int) -> None:
        if num_images:
            self.images_per_request.observe(num_images)

    def observe_report(self, report) -> None:
        encoded, hits, seconds = self._seen
        if report.num_images_encoded > encoded:
            self.images_encoded.inc(report.num_images_encoded - encoded)
        if report.num_encoder_cache_hits > hits:
            self.cache_hits.inc(report.num_encoder_cache_hits - hits)
        if report.encoder_time_s > seconds:
            self.encoder_seconds.inc(report.encoder_time_s - seconds)
        self._seen = (max(encoded, report.num_images_encoded),
                      max(hits, report.num_encoder_cache_hits),
                      max(seconds, report.encoder_time_s))


__all__ = ["VisionMetrics"]
