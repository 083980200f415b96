"""Latency percentiles and goodput of an online (serving) benchmark.

Owns: RequestRecord (what the load generator measured for one request), the summary of a
list of values at p50/p90/p95/p99 and mean, goodput against a TTFT/TPOT SLO, failure counts,
and build_serve_result (the arithmetic behind the `servelm bench serve` JSON).
Never: does I/O or talks to a server; imports torch or the engine.

Definitions (seconds, one monotonic clock; "sent" is when the request was handed to the
HTTP client, which is the scheduled arrival time unless the client fell behind):
  ttft    first content token received - sent
  itl     every gap between two consecutive content chunks of one stream
  tpot    (e2e - ttft) / (num_output_tokens - 1), per request with >= 2 output tokens
  e2e     last byte of the stream - sent
  goodput share of all measured requests (failures included) that succeeded with
          ttft <= slo_ttft and tpot <= slo_tpot (a request with one output token has no
          tpot and meets that half by definition); goodput_req_s is their number per second
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence


PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)  # a simulated fleet keeps millions of them
class RequestRecord:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    num_prompt_tokens: int
    max_tokens: int
    scheduled_time: float = 0.0  # when the arrival process wanted it sent
    sent_time: float = 0.0  # when the client started sending it
    written_time: float | None = None  # request body fully written to the socket
    first_token_time: float | None = None
    end_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # one per content chunk
    num_output_tokens: int = 0  # from the usage chunk; else the number of content chunks
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    has_usage: bool = False
    error: str | None = None  # failure kind: http_<status>, timeout, connection, stream
    error_detail: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.first_token_time is not None \
            and self.end_time is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.sent_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.sent_time

    @property
    def tpot_s(self) -> float | None:
        if not self.is_ok or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        c = self.chunk_times
        return [b - a for a, b in zip(c, c[1:])]

    @property
    def send_delay_s(self) -> float:
        """Client overhead before sending: how late the client was against the schedule."""
        return self.sent_time - self.scheduled_time

    @property
    def write_s(self) -> float | None:
        """Client overhead of sending: sent -> request fully written."""
        return None if self.written_time is None else self.written_time - self.sent_time


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """{"mean", "p50", "p90", "p95", "p99", "max", "n"} of `values` times `scale`
    (linear-interpolated percentiles, numpy's default); None entries when empty."""
    vals = [v * scale for v in values if v is not None]
    out: dict[str, float | None] = {"n": len(vals)}
    if not vals:
        out.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None})
        return out
    out["mean"] = statistics.fmean(vals)
    top = max(vals)
    vals.sort()  # once for every percentile (an ITL summary has one value per token)
    for q in PERCENTILES:
        out[f"p{q}"] = _sorted_percentile(vals, q)
    out["max"] = top
    return out


def _sorted_percentile(s: list[float], q: float) -> float:
    """servelm.bench.results._percentile of an already sorted list (its arithmetic)."""
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def meets_slo(r: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if not r.is_ok:
        return False
    if slo_ttft_s is not None and r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    if slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s:
        return False
    return True


def goodput(records: Sequence[RequestRecord], slo_ttft_s: float | None,
            slo_tpot_s: float | None) -> float:
    """Share of `records` (failures count against it) that meet both SLOs; 0 when empty."""
    if not records:
        return 0.0
    return sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records) / len(records)


def failures_by_kind(records: Sequence[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.error for r in records if r.error is not None).items()))


def build_serve_result(records: Sequence[RequestRecord], elapsed_s: float, *,
                       slo_ttft_s: float | None, slo_tpot_s: float | None,
                       loop_lag_s: Sequence[float] = (),
                       itl_ms: dict[str, Any] | None = None) -> dict[str, Any]:
    """The measured part of a serve result: counts, throughputs, latency summaries (ms),
    goodput, failures and client overhead. `elapsed_s` is first send -> last completion.
    itl_ms: the ITL summary when the caller kept the gaps itself (the simulator folds each
    finished request's chunk times away), else summarized from the records' chunk times."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s}")
    ok = [r for r in records if r.is_ok]
    num_in = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None
                 else r.num_prompt_tokens for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    num_good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    if itl_ms is None:
        itl_ms = summarize((g for r in ok for g in r.itls_s), 1e3)
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "failures": failures_by_kind(records),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "num_expected_output_tokens": sum(r.max_tokens for r in ok),
        "num_without_usage": sum(not r.has_usage for r in ok),
        "elapsed_s": elapsed_s,
        "request_throughput": len(ok) / elapsed_s,
        "output_tok_s": num_out / elapsed_s,
        "total_tok_s": (num_in + num_out) / elapsed_s,
        "ttft_ms": summarize((r.ttft_s for r in ok), 1e3),
        "tpot_ms": summarize((r.tpot_s for r in ok), 1e3),
        "itl_ms": itl_ms,
        "e2e_ms": summarize((r.e2e_s for r in ok), 1e3),
        "slo": {"ttft_ms": None if slo_ttft_s is None else slo_ttft_s * 1e3,
                "tpot_ms": None if slo_tpot_s is None else slo_tpot_s * 1e3},
        "num_good": num_good,
        "goodput": num_good / len(records) if records else 0.0,
        "goodput_req_s": num_good / elapsed_s,
        "client": {
            "send_delay_ms": summarize((r.send_delay_s for r in records), 1e3),
            "write_ms": summarize((r.write_s for r in records), 1e3),
            "loop_lag_ms": summarize(loop_lag_s, 1e3),
        },
    }


# Rows of the readable table: (label, key in the result).
LATENCY_ROWS = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render_serve_table(result: dict[str, Any]) -> str:
    """Headline numbers, then a latency table (ms) with one row per metric."""
    slo = result.get("slo", {})
    fails = result.get("failures") or {}
    lines = [
        f"requests       {result['num_completed']}/{result['num_requests']} completed"
        + (f"; failed: {', '.join(f'{k}={v}' for k, v in fails.items())}" if fails else ""),
        f"elapsed        {result['elapsed_s']:.2f} s",
        f"throughput     {result['request_throughput']:.2f} req/s, "
        f"{result['output_tok_s']:.1f} output tok/s, {result['total_tok_s']:.1f} total tok/s",
        f"tokens         {result['num_input_tokens']} in, {result['num_output_tokens']} out "
        f"({result['num_expected_output_tokens']} requested)",
        f"goodput        {result['goodput'] * 100:.1f}% of requests "
        f"({result['goodput_req_s']:.2f} req/s) meet TTFT <= {_ms(slo.get('ttft_ms'))} ms "
        f"and TPOT <= {_ms(slo.get('tpot_ms'))} ms",
        "",
        f"{'ms':<6}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p95", "p99", "max")),
    ]
    for label, key in LATENCY_ROWS:
        s = result.get(key) or {}
        lines.append(f"{label:<6}" + "".join(
            f"{_ms(s.get(k)):>10}" for k in ("mean", "p50", "p90", "p95", "p99", "max")))
    client = result.get("client") or {}
    if client:
        sd, wr, lag = (client.get(k) or {} for k in ("send_delay_ms", "write_ms", "loop_lag_ms"))
        lines += ["", f"client overhead: send delay p99 {_ms(sd.get('p99'))} ms, write p99 "
                  f"{_ms(wr.get('p99'))} ms, event-loop lag p99 {_ms(lag.get('p99'))} ms "
                  f"(max {_ms(lag.get('max'))} ms)"]
    return "\n".join(lines)
