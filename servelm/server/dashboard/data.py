"""The numbers the dashboard shows, as one JSON object (`GET /dashboard/data`).

Owns: reading the server's Prometheus registry after the same refresh `/metrics` does (so a
gauge or counter shown equals the scraped one), and the sliding-window figures computed from
the Recorder: TTFT / TPOT / e2e percentiles against the SLO, goodput, tokens/s, per-step
bandwidth and compute utilisation (the cost model's bytes and FLOPs per step), and the slowest
recent requests' waterfalls.
Never: touches the engine beyond the snapshot `/metrics` reads, or holds state between calls.
"""

from __future__ import annotations

import math
import time
from typing import Any

from servelm.server.dashboard.records import RequestRecord, StepRecord

DEFAULT_WINDOW_S = 60.0
MAX_WINDOW_S = 3600.0
NUM_SLOWEST = 8
NUM_STEPS_SHOWN = 240

# Shown as they are in /metrics (the browser test checks they are equal).
GAUGES = {
    "running": "servelm_num_requests_running",
    "waiting": "servelm_num_requests_waiting",
    "kv_usage": "servelm_kv_cache_usage_ratio",
    "kv_blocks_used": "servelm_kv_blocks_used",
    "kv_blocks_total": "servelm_kv_blocks_total",
    "prefix_hit_rate": "servelm_prefix_cache_hit_rate",
    "goodput": "servelm_goodput_ratio",
    "engine_alive": "servelm_engine_alive",
    "spec_mean_accepted_length": "servelm_spec_mean_accepted_length",
}
COUNTERS = {
    "requests_finished": ("servelm_requests_finished_total", "finish_reason"),
    "preemptions": ("servelm_preemptions_total", None),
    "generation_tokens": ("servelm_generation_tokens_total", None),
    "prompt_tokens": ("servelm_prompt_tokens_total", None),
    "prefix_hit_tokens": ("servelm_prefix_cache_hit_tokens_total", None),
    "spec_draft_tokens": ("servelm_spec_draft_tokens_total", None),
    "spec_accepted_tokens": ("servelm_spec_accepted_tokens_total", None),
    "slo_met": ("servelm_requests_slo_met_total", None),
    "slo_judged": ("servelm_requests_slo_judged_total", None),
}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def parse_window(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_WINDOW_S
    try:
        window = float(raw)
    except ValueError:
        raise ValueError(f"window must be a number of seconds, got {raw!r}") from None
    if not 1.0 <= window <= MAX_WINDOW_S:
        raise ValueError(f"window must be between 1 and {MAX_WINDOW_S:g} seconds, got {raw}")
    return window


def _registry_values(registry) -> tuple[dict[str, float], dict[str, float]]:
    gauges = {key: registry.get_sample_value(name) for key, name in GAUGES.items()}
    counters = {}
    samples = {}
    for metric in registry.collect():
        for s in metric.samples:
            samples.setdefault(s.name, []).append(s)
    for key, (name, label) in COUNTERS.items():
        counters[key] = sum(s.value for s in samples.get(name, []))
    return ({k: v for k, v in gauges.items() if v is not None}, counters)


def _latency_summary(values: list[float], slo: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    out["count"] = len(values)
    if slo is not None and values:
        out["slo"] = slo
        out["within_slo"] = sum(v <= slo for v in values) / len(values)
    return out


def _step_window(steps: list[StepRecord], window_s: float) -> dict[str, Any]:
    if not steps:
        return {"tokens_per_s": 0.0, "computed_tokens_per_s": 0.0, "steps_per_s": 0.0,
                "bandwidth_util": None, "compute_util": None}
    # Over the window, or since the first step seen when the server is younger than it.
    span = max(1e-9, min(window_s, time.monotonic() - steps[0].start))
    busy = sum(s.step_s for s in steps)
    util = [s for s in steps if s.bandwidth_util is not None]
    # Time-weighted over steps: what the hardware did while the engine was busy.
    bw = sum(s.bandwidth_util * s.step_s for s in util) / busy if util and busy else None
    fl = sum(s.compute_util * s.step_s for s in util) / busy if util and busy else None
    return {"tokens_per_s": sum(s.num_generated for s in steps) / span,
            "computed_tokens_per_s": sum(s.num_tokens for s in steps) / span,
            "steps_per_s": len(steps) / span, "busy_share": min(1.0, busy / span),
            "bandwidth_util": bw, "compute_util": fl}


def waterfall(rec: RequestRecord) -> dict[str, Any]:
    return {"request_id": rec.request_id, "endpoint": rec.endpoint, "status": rec.status,
            "ago_s": round(time.monotonic() - rec.arrival, 3),
            "latency_s": rec.latency_s, "ttft_s": rec.ttft_s, "e2e_s": rec.e2e_s,
            "num_prompt_tokens": rec.num_prompt_tokens,
            "num_output_tokens": rec.num_output_tokens,
            "num_cached_tokens": rec.num_cached_tokens,
            "num_preemptions": rec.num_preemptions,
            "max_chunk_waited": rec.max_chunk_waited,
            "client_blocked_s": rec.client_blocked_s, "gc_s": rec.gc_s,
            "phases": {k: round(v, 6) for k, v in rec.phases.items()}}


def dashboard_data(metrics, window_s: float = DEFAULT_WINDOW_S,
                   include_records: bool = False, include_values: bool = False
                   ) -> dict[str, Any]:
    """The dashboard's JSON from a ServerMetrics already refreshed (as for a scrape)."""
    gauges, counters = _registry_values(metrics.registry)
    recorder = metrics.recorder
    requests = recorder.recent_requests(window_s)
    steps = recorder.recent_steps(window_s)
    judged = [r for r in requests if r.ttft_s is not None and r.status != "client_disconnected"]
    met = [r for r in judged if r.ttft_s <= metrics.slo_ttft_s
           and (r.tpot_s is None or r.tpot_s <= metrics.slo_tpot_s)]
    proposed = counters["spec_draft_tokens"]
    window = {
        "seconds": window_s,
        "num_requests": len(requests),
        "ttft_s": _latency_summary([r.ttft_s for r in requests if r.ttft_s is not None],
                                   metrics.slo_ttft_s),
        "tpot_s": _latency_summary([r.tpot_s for r in requests if r.tpot_s is not None],
                                   metrics.slo_tpot_s),
        "e2e_s": _latency_summary([r.e2e_s for r in requests if r.e2e_s is not None], None),
        "goodput": len(met) / len(judged) if judged else None,
        "preemptions": sum(r.num_preemptions for r in requests),
        "prefix_hit_rate": (sum(r.num_cached_tokens for r in requests)
                            / max(1, sum(r.num_prompt_tokens for r in requests))
                            if requests else None),
        **_step_window(steps, window_s),
    }
    now = time.monotonic()
    slowest = sorted((r for r in requests if r.latency_s is not None),
                     key=lambda r: -(r.latency_s or 0.0))[:NUM_SLOWEST]
    cost = metrics.cost
    out = {
        "model": metrics.model_name,
        "time_unix": time.time(),
        "slo": {"ttft_s": metrics.slo_ttft_s, "tpot_s": metrics.slo_tpot_s},
        "peaks": {"bandwidth": cost.peak_bandwidth if cost else None,
                  "flops": cost.peak_flops if cost else None},
        "max_num_batched_tokens": recorder.max_num_batched_tokens,
        "gauges": gauges,
        "counters": counters,
        "spec_acceptance": counters["spec_accepted_tokens"] / proposed if proposed else None,
        "window": window,
        "steps": [[round(s.end - now, 4), round(s.step_s, 6), s.num_seqs, s.num_tokens,
                   s.max_chunk, s.bandwidth_util, s.compute_util]
                  for s in steps[-NUM_STEPS_SHOWN:]],
        "slowest": [waterfall(r) for r in slowest],
    }
    if include_values:  # raw latencies, so a router can take fleet-wide percentiles
        out["values"] = {k: [getattr(r, k) for r in requests if getattr(r, k) is not None]
                         for k in ("ttft_s", "tpot_s", "e2e_s")}
    if include_records:
        out["records"] = [r.__dict__ | {"arrival_ago_s": now - r.arrival} for r in requests]
        out["step_records"] = [s._asdict() | {"end_ago_s": now - s.end} for s in steps]
    return out


def fleet_data(replicas: list[tuple[str, bool, dict | None]],
               window_s: float) -> dict[str, Any]:
    """The router's view: each replica's dashboard data (fetched with values) merged. Gauges
    and counters add up, ratios are recomputed from their parts, percentiles are taken over
    every replica's requests; `replicas` lists (url, healthy, data or None when unreachable)."""
    datas = [d for _, _, d in replicas if d is not None]
    gauges: dict[str, Any] = {}
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total"):
        gauges[key] = sum(d["gauges"].get(key, 0.0) for d in datas)
    counters = {key: sum(d["counters"].get(key, 0.0) for d in datas) for key in COUNTERS}
    gauges["kv_usage"] = (gauges["kv_blocks_used"] / gauges["kv_blocks_total"]
                          if gauges["kv_blocks_total"] else 0.0)
    gauges["prefix_hit_rate"] = (counters["prefix_hit_tokens"] / counters["prompt_tokens"]
                                 if counters["prompt_tokens"] else 0.0)
    gauges["goodput"] = (counters["slo_met"] / counters["slo_judged"]
                         if counters["slo_judged"] else 0.0)
    gauges["engine_alive"] = float(bool(datas) and all(d["gauges"].get("engine_alive")
                                                       for d in datas))
    values = {k: [v for d in datas for v in d.get("values", {}).get(k, [])]
              for k in ("ttft_s", "tpot_s", "e2e_s")}
    slo = datas[0]["slo"] if datas else {"ttft_s": None, "tpot_s": None}
    judged = sum(d["window"]["num_requests"] for d in datas)
    windows = [d["window"] for d in datas]

    def mean_of(key):
        vals = [w[key] for w in windows if w.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    goodputs = [(w["goodput"], w["num_requests"]) for w in windows if w["goodput"] is not None]
    window = {
        "seconds": window_s, "num_requests": judged,
        "ttft_s": _latency_summary(values["ttft_s"], slo["ttft_s"]),
        "tpot_s": _latency_summary(values["tpot_s"], slo["tpot_s"]),
        "e2e_s": _latency_summary(values["e2e_s"], None),
        "goodput": (sum(g * n for g, n in goodputs) / max(1, sum(n for _, n in goodputs))
                    if goodputs else None),
        "preemptions": sum(w["preemptions"] for w in windows),
        "tokens_per_s": sum(w["tokens_per_s"] for w in windows),
        "computed_tokens_per_s": sum(w["computed_tokens_per_s"] for w in windows),
        "bandwidth_util": mean_of("bandwidth_util"), "compute_util": mean_of("compute_util"),
    }
    slowest = sorted(((dict(r, replica=url)) for url, _, d in replicas if d
                      for r in d["slowest"]), key=lambda r: -(r["latency_s"] or 0.0))
    steps = sorted((s for d in datas for s in d["steps"]), key=lambda s: s[0])
    proposed = counters["spec_draft_tokens"]
    return {
        "model": datas[0]["model"] if datas else "",
        "time_unix": time.time(), "slo": slo,
        "peaks": datas[0]["peaks"] if datas else {},
        "gauges": gauges, "counters": counters,
        "spec_acceptance": counters["spec_accepted_tokens"] / proposed if proposed else None,
        "window": window, "steps": steps[-NUM_STEPS_SHOWN:], "slowest": slowest[:NUM_SLOWEST],
        "replicas": [{"url": url, "healthy": healthy, "reachable": d is not None}
                     for url, healthy, d in replicas],
    }
