"""The inter-token latencies of a simulated run, kept without the requests' chunk times.

Owns: ITLSummary, which takes the gaps between a request's chunks (a finished request's
chunk times, or the gaps one at a time, or weighted: one gap that many requests share, the
simulator's decode head, servelm/sim/bulk.py), so the records need not keep their chunk
times (at 300 tokens a request they are most of a large run's memory), and gives the
`itl_ms` block of `servelm bench serve`'s result. Up to `exact_limit` gaps it keeps every
gap and summarizes them as servelm.bench.metrics.summarize does, so a run that fits gives
the very numbers its records would. Beyond that it bins them: counts in log-spaced bins
0.01% wide, each percentile read at its bin's geometric centre (within 0.005% of the exact
value; the block then says `"binned": true`), the mean and the max still exact: the binned
gaps' sum is kept exactly (an integer count of 2^-1074 s, the finest a float64 holds), so
summaries of parts merge (`merge`, `to_bytes`: a sharded run's, servelm/sim/shards.py)
into the very summary one run over all the gaps gives, in any order.
Never: reads a record's other fields, or anything of the engine.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from servelm.bench.metrics import PERCENTILES, summarize

EXACT_LIMIT = 5_000_000  # gaps kept as values (40 MB as float64); beyond: binned
_BATCH = 1 << 20  # gaps gathered before they are folded in
_LO = 1e-7  # s: the lowest bin's edge (a gap below it, or 0, counts in bin 0)
_WIDTH = math.log1p(1e-4)  # each bin is 0.01% wide
_NUM_BINS = int(math.log(1e5 / _LO) / _WIDTH) + 2  # up to 1e5 s
_SUM_CHUNK = 1 << 24  # gaps summed per pass: 2^24 halves of 27 bits stay exact in a float64


class ITLSummary:
    def __init__(self, exact_limit: int = EXACT_LIMIT):
        self.exact_limit = exact_limit
        self._pending: list[np.ndarray] = []  # gaps not yet folded in
        self._num_pending = 0
        self.gaps: list[float] = []  # single gaps (add_gap), folded in batches
        self._exact: list[np.ndarray] = []  # gap arrays while under the limit
        self._num_exact = 0
        self._counts: np.ndarray | None = None  # bin counts once binned
        self._sum = 0  # of the binned gaps, exactly: in units of 2^-1074 s (_exact_sum)
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
        self._to_bins()  # over the limit: the values kept so far go into bins
        self._bin(gaps)

    def _bin(self, gaps: np.ndarray) -> None:
        with np.errstate(divide="ignore"):
            idx = np.floor(np.log(gaps / _LO) / _WIDTH) + 1
        idx = np.clip(np.nan_to_num(idx, neginf=0), 0, _NUM_BINS - 1).astype(np.int64)
        self._counts += np.bincount(idx, minlength=_NUM_BINS)
        self._sum += _exact_sum(gaps)

    def merge(self, other: "ITLSummary") -> None:
        """Take in other's gaps: the summary is then the one of both parts' gaps together."""
        self._flush()
        other._flush()
        if not other.n:
            return
        if self._counts is None and other._counts is None \
                and self.n + other.n <= self.exact_limit:
            self._exact.extend(other._exact)
            self._num_exact += other._num_exact
        else:
            self._to_bins()
            if other._counts is not None:
                self._counts += other._counts
                self._sum += other._sum
            for kept in other._exact:
                self._bin(kept)
        self.n += other.n
        self._max = max(self._max, other._max)

    def _to_bins(self) -> None:
        if self._counts is None:
            self._counts = np.zeros(_NUM_BINS, dtype=np.int64)
            for kept in self._exact:
                self._bin(kept)
            self._exact, self._num_exact = [], 0

    def to_bytes(self) -> bytes:
        """Its state, msgpack: what ITLSummary.from_bytes makes again."""
        self._flush()
        exact = np.concatenate(self._exact) if self._exact else np.zeros(0)
        return msgspec.msgpack.encode({
            "exact_limit": self.exact_limit, "n": self.n, "max": self._max,
            "exact": exact.astype("<f8").tobytes(),
            "counts": None if self._counts is None else self._counts.astype("<i8").tobytes(),
            "sum": hex(self._sum)})  # an integer wider than msgpack's 64 bits

    @classmethod
    def from_bytes(cls, data: bytes) -> "ITLSummary":
        state = msgspec.msgpack.decode(data)
        out = cls(state["exact_limit"])
        out.n, out._max, out._sum = state["n"], state["max"], int(state["sum"], 16)
        exact = np.frombuffer(state["exact"], dtype="<f8").astype(np.float64)
        if len(exact):
            out._exact, out._num_exact = [exact], len(exact)
        if state["counts"] is not None:
            out._counts = np.frombuffer(state["counts"], dtype="<i8").astype(np.int64)
        return out

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
        # the exact sum over n, rounded once (Python's int division is correctly rounded)
        out: dict = {"n": self.n, "mean": self._sum / (self.n << 1074) * 1e3}
        for q in PERCENTILES:  # the rank summarize's interpolation starts from
            rank = int((self.n - 1) * q / 100.0)
            b = int(np.searchsorted(cum, rank + 1))
            out[f"p{q}"] = _centre(b) * 1e3
        out["max"] = self._max * 1e3
        out["binned"] = True
        return out


def _exact_sum(gaps: np.ndarray) -> int:
    """The sum of non-negative float64 gaps, exactly, in units of 2^-1074: each gap is
    m * 2^e (frexp: m in [0.5, 1), so m * 2^53 is an integer), split into two halves of 27
    and 26 bits whose sums per exponent (np.bincount in float64) stay below 2^53, exact."""
    total = 0
    for start in range(0, len(gaps), _SUM_CHUNK):
        m, e = np.frexp(gaps[start:start + _SUM_CHUNK])
        if not len(e):
            continue
        low_e = int(e.min())
        at = e - low_e
        hi = np.floor(m * 2.0 ** 27)
        sum_hi = np.bincount(at, weights=hi)
        sum_lo = np.bincount(at, weights=m * 2.0 ** 53 - hi * 2.0 ** 26)
        for i in np.flatnonzero(sum_hi + sum_lo).tolist():  # value = int * 2^(e - 53)
            total += ((int(sum_hi[i]) << 26) + int(sum_lo[i])) << (i + low_e - 53 + 1074)
    return total


def _centre(b: int) -> float:
    """The geometric centre of bin b (bin 0: below _LO)."""
    if b == 0:
        return 0.0
    return _LO * math.exp((b - 0.5) * _WIDTH)


__all__ = ["EXACT_LIMIT", "ITLSummary"]
