"""BandwidthMeter: a tier's read bandwidth, measured.

Owns: a start-up probe (timing real copies of a block-sized buffer through the tier's own
read path) and an exponentially weighted average of the reads the tier then serves;
MeteredTier, a tier's TierStore bandwidth_Bps and observe_read from its meter. Never:
a figure from a table; the planner's tier bandwidths (servelm/planner/hardware.py) are
estimates for machines that are not this one, `servelm plan offload` uses those.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_ALPHA = 0.2  # weight of the newest read: a few reads move the estimate, one outlier does not
_MIN_READ_S = 1e-6  # below this a timer's resolution is the measurement


class BandwidthMeter:
    def __init__(self, initial_Bps: float = 0.0):
        self.bandwidth_Bps = initial_Bps
        self.num_samples = 0

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds < _MIN_READ_S:
            return
        bw = num_bytes / seconds
        self.num_samples += 1
        if self.bandwidth_Bps <= 0 or self.num_samples == 1:
            self.bandwidth_Bps = bw
        else:
            self.bandwidth_Bps = (1 - _ALPHA) * self.bandwidth_Bps + _ALPHA * bw

    def probe(self, read: Callable[[], int], repeats: int = 3) -> float:
        """Seed the estimate from the best of a few timed reads (`read` returns its bytes)."""
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = read()
            dt = time.perf_counter() - t0
            if n > 0 and dt >= _MIN_READ_S:
                best = max(best, n / dt)
        if best > 0:
            self.bandwidth_Bps = best
        return best


class MeteredTier:
    """A tier's bandwidth_Bps and observe_read (TierStore), from its BandwidthMeter."""

    _meter: BandwidthMeter

    @property
    def bandwidth_Bps(self) -> float:
        return self._meter.bandwidth_Bps

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        self._meter.observe(num_bytes, seconds)
