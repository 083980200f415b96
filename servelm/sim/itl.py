"""The inter-token latencies of a simulated run, kept without the requests' chunk times.

Owns: ITLSummary, which takes the gaps between a request's chunks (a finished request's
chunk times, or the gaps one at a time, or weighted: one gap that many requests share, the
simulator's decode head, servelm/sim/bulk.py), so the records need not keep their chunk
times (at 300 tokens a request they are most of a large run's memory), and gives the
`itl_ms` block of `servelm bench serve`'s result. Up to `exact_limit` gaps it keeps every
gap and summarizes them as servelm.bench.metrics.summarize does, so a run that fits gives
the very numbers its records would. Beyond that it bins them: counts in log-spaced bins
0.01% wide, each percentile read at its bin's geometric centre (within 0.005% of the exact
value; the block then says `"binned": true`), the mean and the max still exact.
Never: reads a record's other fields, or anything of the engine.
"""

from __future__ import annotations

import math

import numpy as np

from servelm.bench.metrics import PERCENTILES, summarize

EXACT_LIMIT = 5_000_000  # gaps kept as values (40 MB as float64); beyond: binned
_BATCH = 1 << 20  # gaps gathered before they are folded in
_LO = 1e-7  # s: the lowest bin's edge (a gap below it, or 0, counts in bin 0)
_WIDTH = math.log1p(1e-4)  # each bin is 0.01% wide
_NUM_BINS = int(math.log(1e5 / _LO) / _WIDTH) + 2  # up to 1e5 s


class ITLSummary:
    def __init__(self, exact_limit: int = EXACT_LIMIT):
        self.exact_limit = exact_limit
        self._pending: list[np.ndarray] = []  # gaps not yet folded in
        self._num_pending = 0
        self.gaps: list[float] = []  # single gaps (add_gap), folded in batches
        self._exact: list[np.ndarray] = []  # gap arrays while under the limit
        self._num_exact = 0
        self._counts: np.ndarray | None = None  # bin counts once binned
        self._sum = 0.0  # of the binned gaps
        self._max = -math.inf
        self.n = 0

    def add(self, chunk_times) -> None:
        """One finished request's chunk times (its gaps are the differences)."""
        if len(chunk_times) < 2:
            return
        self._push(np.diff(np.array(chunk_times, dtype=np.float64)))

    def add_gap(self, gap: float) -> None:
        self.gaps.append(gap)
        if len(self.gaps) >= _BATCH:
            self._push(np.array(self.gaps, dtype=np.float64))
            self.gaps = []

    def add_weighted(self, gaps: np.ndarray, counts: np.ndarray) -> None:
        """Gap i, counts[i] times."""
        self._push(np.repeat(gaps, counts))

    def _push(self, gaps: np.ndarray) -> None:
        self._pending.append(gaps)
        self._num_pending += len(gaps)
        if self._num_pending >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        if self.gaps:
            self._pending.append(np.array(self.gaps, dtype=np.float64))
            self.gaps = []
        if not self._pending:
            return
        gaps = np.concatenate(self._pending)
        self._pending, self._num_pending = [], 0
        if not len(gaps):
            return
        self.n += len(gaps)
        self._max = max(self._max, float(gaps.max()))
        if self._counts is None and self._num_exact + len(gaps) <= self.exact_limit:
            self._exact.append(gaps)
            self._num_exact += len(gaps)
            return
        if self._counts is None:  # over the limit: the values kept so far go into bins
            self._counts = np.zeros(_NUM_BINS, dtype=np.int64)
            for kept in self._exact:
                self._bin(kept)
            self._exact, self._num_exact = [], 0
        self._bin(gaps)

    def _bin(self, gaps: np.ndarray) -> None:
        with np.errstate(divide="ignore"):
            idx = np.floor(np.log(gaps / _LO) / _WIDTH) + 1
        idx = np.clip(np.nan_to_num(idx, neginf=0), 0, _NUM_BINS - 1).astype(np.int64)
        self._counts += np.bincount(idx, minlength=_NUM_BINS)
        self._sum += float(gaps.sum())  # numpy's pairwise sum

    @property
    def binned(self) -> bool:
        return self._counts is not None

    def summary_ms(self) -> dict:
        """The `itl_ms` block: summarize's keys (n, mean, percentiles, max) in ms."""
        self._flush()
        if self._counts is None:
            gaps = np.concatenate(self._exact) if self._exact else np.zeros(0)
            return summarize(gaps.tolist(), 1e3)
        counts = self._counts
        cum = np.cumsum(counts)
        out: dict = {"n": self.n, "mean": self._sum / self.n * 1e3}
        for q in PERCENTILES:  # the rank summarize's interpolation starts from
            rank = int((self.n - 1) * q / 100.0)
            b = int(np.searchsorted(cum, rank + 1))
            out[f"p{q}"] = _centre(b) * 1e3
        out["max"] = self._max * 1e3
        out["binned"] = True
        return out


def _centre(b: int) -> float:
    """The geometric centre of bin b (bin 0: below _LO)."""
    if b == 0:
        return 0.0
    return _LO * math.exp((b - 0.5) * _WIDTH)


__all__ = ["EXACT_LIMIT", "ITLSummary"]
