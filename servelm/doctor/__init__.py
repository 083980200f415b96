"""The p99 doctor: given a window of per-request records, rank the usual causes of a tail
that moved while the median did not, each with the evidence for it.

Owns: `diagnose(records, ...) -> Diagnosis`: the tail (requests above the chosen percentile
of the chosen latency) against the body (at or below the median), and for each suspect the
share of the tail's excess latency it explains on the requests that carry its signature:

  suspect        signature on a tail request                      time it explains
  queueing       arrived in a burst (arrivals within a median      queue while the KV
                 latency either side >= 3x the body's)             pool was not full
  long_prefill   a step before its first token held another        time in such steps
                 sequence's chunk >= 4x the body's prompts, or     (+ its own prefill)
                 its own prompt is >= 4x the body's
  preemption     preempted, or queued most of its excess while     queue while the pool
                 the KV pool was >= 90% full                       was full (+ recompute)
  prefix_cache   found much less of its prompt in the prefix        its own prefill
                 cache than the body did
  host           parse / template / tokenize, GC, or delivery      host + GC + delivery lag
                 lag on the front end's event loop
  slow_client    its writes waited on the client's socket           client-blocked time

A suspect's score is that explained share averaged over the tail, where a request's
explained time is its component less the body's median component (what fast requests also
pay explains nothing), capped at its own excess over the median latency.
Never: reads a clock (the records carry their times), or guesses when there are too few
requests to have a tail (an error says how many are needed).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

from servelm.server.dashboard.records import KV_FULL, RequestRecord

METRICS = ("ttft", "tpot", "e2e", "latency")
# A tail of TPOT is made in the decode steps: only what acts on them is a suspect there.
TPOT_SUSPECTS = ("long_prefill", "preemption")
MIN_REQUESTS = 20
MIN_EXCESS_S, MIN_RATIO = 0.010, 1.5  # a tail closer to the median than this is not broken
MIN_SCORE = 0.1  # below this share of the tail's excess a suspect is not named as the cause
MIN_STALL_S = 0.005  # a host or client delay shorter than this is noise, not a signature
SUSPECTS = ("queueing", "long_prefill", "preemption", "prefix_cache", "host", "slow_client")


class DoctorInputError(ValueError):
    """Bad input to the doctor; the message names the parameter."""


def metric_value(rec: RequestRecord, metric: str) -> float | None:
    """ttft: as the client saw it (engine TTFT + the delay until the token was written);
    tpot: first to last token over the tokens after the first; e2e: arrival to last token;
    latency: arrival to the front end's last byte."""
    if metric == "ttft":
        if rec.ttft_s is None:
            return None
        return rec.ttft_s + (rec.delivery_lag_s or 0.0)
    if metric == "tpot":
        return rec.tpot_s
    if metric == "e2e":
        return rec.e2e_s
    if metric == "latency":
        return rec.latency_s
    raise DoctorInputError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")


@dataclass
class Suspect:
    name: str
    score: float  # share of the tail's excess latency explained, 0..1
    tail_share: float  # tail requests carrying the signature
    body_share: float  # body requests carrying it
    evidence: str
    advice: str

    def to_dict(self) -> dict:
        return {"name": self.name, "score": round(self.score, 4),
                "tail_share": round(self.tail_share, 4),
                "body_share": round(self.body_share, 4),
                "evidence": self.evidence, "advice": self.advice}


@dataclass
class Diagnosis:
    metric: str
    quantile: float
    num_requests: int
    num_tail: int
    p50: float
    pq: float
    suspects: list[Suspect] = field(default_factory=list)

    @property
    def is_broken(self) -> bool:
        """The tail stands out from the median by both a ratio and a margin."""
        margin = MIN_EXCESS_S / 10 if self.metric == "tpot" else MIN_EXCESS_S  # per token
        return self.pq - self.p50 >= margin and self.pq >= MIN_RATIO * self.p50

    @property
    def is_explained(self) -> bool:
        return self.is_broken and self.top is not None and self.top.score >= MIN_SCORE

    @property
    def top(self) -> Suspect | None:
        return self.suspects[0] if self.suspects else None

    def to_dict(self) -> dict:
        return {"metric": self.metric, "quantile": self.quantile,
                "broken_tail": self.is_broken, "explained": self.is_explained,
                "num_requests": self.num_requests, "num_tail": self.num_tail,
                "p50_s": self.p50, "p_tail_s": self.pq,
                "suspects": [s.to_dict() for s in self.suspects]}

    def render(self) -> str:
        q = _qname(self.quantile)
        lines = [f"{self.metric} over {self.num_requests} requests: p50 {_ms(self.p50)}, "
                 f"{q} {_ms(self.pq)} ({self.pq / max(self.p50, 1e-9):.1f}x); "
                 f"tail: the {self.num_tail} slowest", ""]
        if not self.is_broken:
            margin = MIN_EXCESS_S / 10 if self.metric == "tpot" else MIN_EXCESS_S
            lines += [f"The tail is within {margin * 1000:g} ms or {MIN_RATIO:g}x of the "
                      "median: there is no broken tail to explain.", ""]
        elif not self.is_explained:
            lines += [f"No suspect explains {_pct(MIN_SCORE)} of the tail's excess: the tail may "
                      "be the workload's own spread (longer outputs, varied prompts) or a cause "
                      "outside the server (the network, a proxy, the client's clock).", ""]
        for i, s in enumerate(self.suspects, 1):
            lines.append(f"{i}. {s.name:<13} explains {100 * s.score:4.0f}% of the tail's "
                         f"excess  (signature: tail {100 * s.tail_share:.0f}%, "
                         f"body {100 * s.body_share:.0f}%)")
            lines.append(f"   {s.evidence}")
            if s.advice:
                lines.append(f"   -> {s.advice}")
        return "\n".join(lines)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.0f} ms" if s < 10 else f"{s:.1f} s"


def _qname(q: float) -> str:
    return f"p{100 * q:g}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


class _Window:
    """The records with the chosen metric, split into tail and body."""

    def __init__(self, records: list[RequestRecord], metric: str, quantile: float,
                 min_tail: int):
        self.records = [r for r in records if metric_value(r, metric) is not None]
        if len(self.records) < MIN_REQUESTS:
            raise DoctorInputError(
                f"records: {len(self.records)} requests with a {metric}; the doctor needs at "
                f"least {MIN_REQUESTS} to tell a tail from the median")
        self.value = {id(r): metric_value(r, metric) for r in self.records}
        values = list(self.value.values())
        self.p50 = _quantile(values, 0.5)
        self.pq = _quantile(values, quantile)
        ranked = sorted(self.records, key=lambda r: -self.value[id(r)])
        n_tail = max(min_tail, math.ceil((1 - quantile) * len(ranked)))
        n_tail = min(n_tail, len(ranked) // 4)
        self.tail = ranked[:n_tail]
        self.body = [r for r in self.records if self.value[id(r)] <= self.p50]
        arrivals = sorted(r.arrival for r in records)
        self._arrivals = arrivals

    def excess(self, r: RequestRecord) -> float:
        return max(1e-9, self.value[id(r)] - self.p50)

    def arrivals_around(self, r: RequestRecord, seconds: float) -> int:
        """Other requests arriving within `seconds` either side of this one."""
        a = self._arrivals
        return (bisect.bisect_right(a, r.arrival + seconds)
                - bisect.bisect_left(a, r.arrival - seconds) - 1)

    def body_median(self, f: Callable[[RequestRecord], float]) -> float:
        return median(f(r) for r in self.body) if self.body else 0.0

    def tail_median(self, f: Callable[[RequestRecord], float]) -> float:
        return median(f(r) for r in self.tail)


def _explained(w: _Window, signature: Callable[[RequestRecord], bool],
               component: Callable[[RequestRecord], float]) -> tuple[float, float, float]:
    """(score, tail share, body share) of one suspect."""
    base = w.body_median(component)
    tail_sig = [signature(r) for r in w.tail]
    body_sig = [signature(r) for r in w.body]
    tail_share = sum(tail_sig) / len(tail_sig)
    body_share = sum(body_sig) / len(body_sig) if body_sig else 0.0
    explained = sum(min(1.0, max(0.0, component(r) - base) / w.excess(r))
                    for r, s in zip(w.tail, tail_sig) if s) / len(w.tail)
    return explained, tail_share, body_share


def _uncached(r: RequestRecord) -> int:
    return max(0, r.num_prompt_tokens - r.num_cached_tokens)


def _cached_share(r: RequestRecord) -> float:
    return r.num_cached_tokens / r.num_prompt_tokens if r.num_prompt_tokens else 0.0


def _suggest_budget(budget: int | None, body_prompt_p90: int) -> int:
    """A quarter of the budget, but room for two of the usual prompts in one step."""
    room = 1 << max(8, math.ceil(math.log2(max(1, body_prompt_p90) * 2)))
    return room if budget is None else max(room, budget // 4)


def diagnose(records: list[RequestRecord], metric: str = "ttft", quantile: float = 0.99,
             min_tail: int = 5, max_num_batched_tokens: int | None = None) -> Diagnosis:
    if metric not in METRICS:
        raise DoctorInputError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if not 0.5 < quantile < 1:
        raise DoctorInputError(f"quantile must be between 0.5 and 1 (exclusive), got {quantile}")
    if min_tail < 1:
        raise DoctorInputError(f"min_tail must be at least 1, got {min_tail}")
    w = _Window(records, metric, quantile, min_tail)
    budget = max_num_batched_tokens or next(
        (r.max_num_batched_tokens for r in records if r.max_num_batched_tokens), None)
    if metric == "tpot":
        out = _tpot_suspects(w, budget, _qname(quantile))
        out.sort(key=lambda s: (-s.score, -s.tail_share))
        return Diagnosis(metric, quantile, len(w.records), len(w.tail), w.p50, w.pq, out)
    q = _qname(quantile)
    label = f"requests above {q} {metric.upper() if metric == 'ttft' else metric}"
    out = []

    # Queueing behind a burst: arrivals around this one, within about a median latency
    # either side (a burst is what lands faster than the server turns requests around), or
    # a queue already standing when it came (a later arrival behind a burst's backlog).
    span = max(0.025, w.p50)
    arrivals = lambda r: w.arrivals_around(r, span)
    body_arrivals = w.body_median(arrivals)
    waiting = lambda r: r.num_waiting_at_arrival
    body_waiting = w.body_median(waiting)
    burst = lambda r: (arrivals(r) >= max(3, 3 * body_arrivals)
                       or waiting(r) >= max(3, 3 * body_waiting))
    # Time queued while the KV pool was full is the pool's (preemption's), not the burst's.
    queue = lambda r: max(0.0, (r.queue_s or 0.0) - r.queue_kv_full_s)
    score, ts, bs = _explained(w, burst, queue)
    out.append(Suspect(
        "queueing", score, ts, bs,
        f"{_pct(ts)} of {label} arrived with {w.tail_median(arrivals):.0f} others within "
        f"{_ms(span)} (body median {body_arrivals:.0f}) and queued "
        f"{_ms(w.tail_median(queue))} (body {_ms(w.body_median(queue))}); "
        f"{w.tail_median(waiting):.0f} were waiting when they arrived (body "
        f"{body_waiting:.0f})",
        "absorb bursts with more replicas or a higher --max-num-seqs (if the KV pool allows); "
        "bound the wait with --max-queue so the excess is refused (429) rather than queued"))

    # A long prefill: another sequence's chunk stalling the steps before this request's first
    # token, or the request's own long prompt (a prompt far longer than the body's, not one
    # the cache usually covers: that is prefix_cache's).
    body_prompt = w.body_median(_uncached)
    threshold = max(256, int(4 * body_prompt))
    long_own = max(256, int(4 * w.body_median(lambda r: r.num_prompt_tokens)))
    behind_long = lambda r: r.max_chunk_waited >= threshold
    own_long = lambda r: r.num_prompt_tokens >= long_own
    long_chunk = lambda r: behind_long(r) or own_long(r)
    prefilling = lambda r: r.behind_chunks_s + ((r.prefill_s or 0.0) if own_long(r) else 0.0)
    score, ts, bs = _explained(w, long_chunk, prefilling)
    hit = [r for r in w.tail if behind_long(r)]
    own = [r for r in w.tail if own_long(r)]
    largest = max([r.max_chunk_waited for r in hit] + [min(r.num_prompt_tokens, budget or
                                                          r.num_prompt_tokens) for r in own],
                  default=0)
    body_p90 = int(_quantile([_uncached(r) for r in w.body], 0.9)) if w.body else 0
    suggest = _suggest_budget(budget, body_p90)
    stall = median(r.behind_chunks_s for r in hit) if hit else 0.0
    out.append(Suspect(
        "long_prefill", score, ts, bs,
        f"{_pct(len(hit) / len(w.tail))} of {label} waited behind a prefill chunk of more "
        f"than {threshold:,} tokens and {_pct(len(own) / len(w.tail))} were such prompts "
        f"themselves (largest chunk {largest:,}; body prompts ~{body_prompt:.0f} uncached "
        f"tokens); chunk budget {f'{budget:,}' if budget else 'unknown'}; median stall behind "
        f"such steps {_ms(stall)}"
        + (f" (at a {suggest:,}-token chunk about {_ms(stall * suggest / largest)}, scaling "
           "the measured steps by their chunk)" if hit and largest and suggest < largest
           else ""),
        f"lower the chunk budget to {suggest:,} (--max-num-batched-tokens) so a long prompt "
        "is spread over more, shorter steps; or route long prompts to their own replicas"
        if budget is None or suggest < budget else
        "the budget is already small: route long prompts to their own replicas "
        "(or disaggregate prefill)"))

    # Preemption / a KV pool too small: waiting for blocks, or recomputing after losing them.
    kv_wait = lambda r: r.queue_kv_full_s + (
        (r.prefill_s or 0.0) + (r.prefill_wait_s or 0.0) if r.num_preemptions else 0.0)
    kv_pressed = lambda r: r.num_preemptions > 0 or \
        r.queue_kv_full_s >= max(MIN_STALL_S, 0.5 * w.excess(r))
    score, ts, bs = _explained(w, kv_pressed, kv_wait)
    num_pre = sum(r.num_preemptions for r in w.tail)
    out.append(Suspect(
        "preemption", score, ts, bs,
        f"{_pct(ts)} of {label} were preempted ({num_pre} preemptions among them; "
        f"{sum(r.num_preemptions for r in w.records)} in the window) or queued while the KV "
        f"pool was >= {_pct(KV_FULL)} full ({_ms(w.tail_median(lambda r: r.queue_kv_full_s))} "
        f"median, body {_ms(w.body_median(lambda r: r.queue_kv_full_s))})",
        "give the KV cache more memory (--kv-cache-memory), lower --max-num-seqs, or cap "
        "max_tokens: the pool cannot hold this concurrency"))

    # Prefix-cache misses or evictions.
    body_cached = w.body_median(_cached_share)
    missed = lambda r: _cached_share(r) <= body_cached - 0.3
    own_prefill = lambda r: r.prefill_s or 0.0
    score, ts, bs = _explained(w, missed, own_prefill)
    out.append(Suspect(
        "prefix_cache", score, ts, bs,
        f"{_pct(ts)} of {label} found {_pct(w.tail_median(_cached_share))} of their prompt in "
        f"the prefix cache against {_pct(body_cached)} for the median request; their own "
        f"prefill took {_ms(w.tail_median(own_prefill))} (body {_ms(w.body_median(own_prefill))})",
        "the shared prefix is being evicted: more KV blocks for the cache, prefix-affinity "
        "routing (servelm router --policy prefix_affinity), or fewer distinct long prefixes"))

    # Host-side stalls on the front end.
    host = lambda r: (r.host_s or 0.0) + r.gc_s + (r.delivery_lag_s or 0.0)
    base = w.body_median(host)
    stalled = lambda r: host(r) - base >= max(MIN_STALL_S, 0.25 * w.excess(r))
    score, ts, bs = _explained(w, stalled, host)
    out.append(Suspect(
        "host", score, ts, bs,
        f"{_pct(ts)} of {label} lost time on the front end: before reaching the engine "
        f"{_ms(w.tail_median(lambda r: r.host_s or 0.0))} (body "
        f"{_ms(w.body_median(lambda r: r.host_s or 0.0))}), GC "
        f"{_ms(w.tail_median(lambda r: r.gc_s))}, token delivery lag "
        f"{_ms(w.tail_median(lambda r: r.delivery_lag_s or 0.0))}",
        "look for event-loop blocking work (tokenizing or templating long inputs inline, "
        "logging, GC of large objects) and move it off the loop"))

    # A slow client holding the stream.
    blocked = lambda r: r.client_blocked_s
    base = w.body_median(blocked)
    slow = lambda r: blocked(r) - base >= max(MIN_STALL_S, 0.25 * w.excess(r))
    score, ts, bs = _explained(w, slow, blocked)
    out.append(Suspect(
        "slow_client", score, ts, bs,
        f"{_pct(ts)} of {label} spent {_ms(w.tail_median(blocked))} (median) waiting to write "
        f"to the client's socket (body {_ms(w.body_median(blocked))})",
        "the readers are slow, not the server: their own latency is theirs; --write-timeout "
        "drops readers stalled past it"))

    out.sort(key=lambda s: (-s.score, -s.tail_share))
    return Diagnosis(metric, quantile, len(w.records), len(w.tail), w.p50, w.pq, out)


def _per_token(r: RequestRecord, seconds: float) -> float:
    return seconds / max(1, r.num_output_tokens - 1)


def _tpot_suspects(w: _Window, budget: int | None, q: str) -> list[Suspect]:
    """TPOT's tail: decode steps slowed by other sequences' prefill chunks, or a sequence
    preempted mid-decode (its wait and recompute land between two of its tokens)."""
    label = f"requests above {q} TPOT"
    threshold = max(256, int(4 * w.body_median(_uncached)))
    stalled = lambda r: r.decode_max_chunk >= threshold
    in_prefill = lambda r: _per_token(r, r.decode_prefill_s)
    score, ts, bs = _explained(w, stalled, in_prefill)
    body_p90 = int(_quantile([_uncached(r) for r in w.body], 0.9)) if w.body else 0
    suggest = _suggest_budget(budget, body_p90)
    hit = [r for r in w.tail if stalled(r)]
    out = [Suspect(
        "long_prefill", score, ts, bs,
        f"{_pct(ts)} of {label} decoded through steps holding a prefill chunk of more than "
        f"{threshold:,} tokens (largest {max((r.decode_max_chunk for r in hit), default=0):,}); "
        f"such steps cost them {_ms(median(in_prefill(r) for r in hit) if hit else 0.0)} a "
        f"token (body {_ms(w.body_median(in_prefill))}); chunk budget "
        f"{f'{budget:,}' if budget else 'unknown'}",
        f"lower the chunk budget to {suggest:,} (--max-num-batched-tokens): each long prompt "
        "then stalls the streams for shorter steps" if budget is None or suggest < budget else
        "route long prompts to their own replicas (or disaggregate prefill)")]
    preempted = lambda r: r.num_preemptions > 0
    excess = lambda r: w.excess(r) if preempted(r) else 0.0
    score, ts, bs = _explained(w, preempted, excess)
    out.append(Suspect(
        "preemption", score, ts, bs,
        f"{_pct(ts)} of {label} were preempted while decoding "
        f"({sum(r.num_preemptions for r in w.tail)} preemptions among them): their wait and "
        "recompute fall between two of their tokens (attributed whole: it is not measured "
        "apart)",
        "give the KV cache more memory (--kv-cache-memory) or lower --max-num-seqs"))
    return out


__all__ = [
    "METRICS",
    "SUSPECTS",
    "Diagnosis",
    "DoctorInputError",
    "Suspect",
    "diagnose",
    "metric_value",
]
