"""Prometheus metrics of one server, in its own CollectorRegistry.

Owns: every `servelm_*` metric, the per-step observer the engine thread calls (step time,
batch shape, estimated bandwidth / compute utilisation, per-token latency), per-request
histograms from RequestTimings (TTFT, TPOT, e2e, queue, prefill, decode), goodput against the
SLOs, the request timing breakdown (`timing_breakdown`) used by the log line and the
`x-servelm-timing` header, and the Recorder of recent steps and request records that the
dashboard, `servelm doctor` and the traces read (servelm/server/dashboard/records.py).
Never: blocks (prometheus_client is thread-safe; the observer only does arithmetic), or holds
per-request state beyond the last token time of live sequences.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from servelm import cost
from servelm.config import EngineArgs, ModelConfig
from servelm.cost import WeightBytes
from servelm.planner.hardware import default_peaks
from servelm.vision.metrics import VisionMetrics
from servelm.protocol import RequestTimings, TokenDelta
from servelm.disagg.metrics import DisaggMetrics
from servelm.kv_tiers.metrics import KVTierMetrics
from servelm.server.dashboard.records import Recorder, StepRecord, build_record

# Defaults when --peak-bandwidth / --peak-flops are not given (documented in docs/server.md),
# from the planner's hardware table: a CPU socket's DRAM bandwidth and fp32 FLOPs, and an
# H100-SXM's HBM3 and dense bf16 FLOPs.
DEFAULT_PEAKS = {device: default_peaks(device) for device in ("cpu", "cuda")}

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                          0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_RATIO_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7,
                  0.8, 0.9, 1.0)
_SPEC_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# servelm_requests_rejected_total{reason}: a limit's error code names the reason; any other
# 4xx is "invalid". The connection-level limits (draining_server.py) count themselves.
REJECTION_REASON_BY_CODE = {
    "slo_unattainable": "slo_unattainable",
    "queue_full": "queue_full",
    "server_draining": "draining",
    "request_too_large": "body_too_large",
    "context_length_exceeded": "context_length",
    "too_many_prompts": "too_many_prompts",
    "too_many_choices": "too_many_choices",
    "cache_salt_too_long": "cache_salt_too_long",
}
REJECTION_REASONS = (*dict.fromkeys(REJECTION_REASON_BY_CODE.values()), "invalid",
                     "too_many_connections", "header_timeout")


def timing_breakdown(timings: RequestTimings | None, num_prompt_tokens: int,
                     num_output_tokens: int) -> dict[str, Any]:
    """Where one request's time went; None fields were never reached (e.g. aborted early)."""
    if timings is None:
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens}
    out = timings.to_dict()
    decode = None
    if timings.first_token_time is not None and timings.last_token_time is not None:
        decode = timings.last_token_time - timings.first_token_time
    out["decode_s"] = decode
    out["tpot_s"] = (decode / (num_output_tokens - 1)
                     if decode is not None and num_output_tokens > 1 else None)
    # Time between being scheduled and the first token, not spent computing this prompt:
    # the share of TTFT lost to other requests' work sharing the steps.
    if timings.first_token_time is not None and timings.first_scheduled_time is not None:
        out["prefill_wait_s"] = max(0.0, timings.first_token_time - timings.first_scheduled_time
                                    - timings.prefill_time)
    out["prompt_tokens"] = num_prompt_tokens
    out["completion_tokens"] = num_output_tokens
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


@dataclass(frozen=True)
class CostModel:
    """Bytes and FLOPs one step must move / do, from the model's shape and the engine's
    options (servelm.cost: the planner and the benchmarks count the same way). Weights count
    as the layers hold them (quantized codes and scales, packed linears), not as
    `model.parameters()` lists them."""

    model_config: ModelConfig
    weight_bytes_per_param: WeightBytes
    kv_bytes_per_token: float
    peak_bandwidth: float
    peak_flops: float

    @classmethod
    def from_config(cls, model_config: ModelConfig, *, dtype: str, quantization: str | None,
                    kv_cache_dtype: str, device_type: str, peak_bandwidth: float | None,
                    peak_flops: float | None) -> CostModel:
        bw, flops = DEFAULT_PEAKS.get(device_type, DEFAULT_PEAKS["cpu"])
        return cls(model_config, cost.weight_bytes_per_param(model_config, quantization, dtype),
                   cost.kv_bytes_per_token(model_config, cost.kv_dtype_bytes(kv_cache_dtype,
                                                                             dtype)),
                   peak_bandwidth or bw, peak_flops or flops)

    @classmethod
    def from_engine(cls, engine, peak_bandwidth: float | None,
                    peak_flops: float | None) -> CostModel:
        """An in-process Engine: its ModelConfig and the EngineArgs it was built with."""
        args = getattr(engine, "engine_args", None) or EngineArgs(model="", dtype="float32")
        return cls.from_config(engine.model_config, dtype=args.dtype,
                               quantization=args.quantization,
                               kv_cache_dtype=args.kv_cache_dtype,
                               device_type=args.device.split(":")[0],
                               peak_bandwidth=peak_bandwidth, peak_flops=peak_flops)

    @property
    def weight_bytes(self) -> float:
        """Weight bytes one decode step reads."""
        return cost.weight_bytes_read_per_step(self.model_config, 1,
                                               self.weight_bytes_per_param)

    def step_cost(self, stats) -> tuple[float, float]:
        """(bytes, flops) of the engine's last step."""
        c = cost.step_cost(self.model_config, self.weight_bytes_per_param,
                           self.kv_bytes_per_token, stats.last_num_tokens,
                           stats.last_num_context_tokens, stats.last_num_attention_pairs)
        return c.bytes, c.flops


class ServerMetrics:
    def __init__(self, model_name: str, slo_ttft_s: float, slo_tpot_s: float,
                 cost: CostModel | None = None, recorder: Recorder | None = None,
                 slo_spec=None):
        self.registry = r = CollectorRegistry()
        self.recorder = recorder or Recorder()
        self.model_name = model_name
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.cost = cost
        self._lock = threading.Lock()
        self._last_token_time: dict[tuple[str, int], float] = {}
        self._num_preemptions_seen = 0
        self.vision = VisionMetrics(r)  # images, encoder time, encoder cache hits
        self._num_slo_met = 0
        self._num_slo_judged = 0
        self._num_cached = 0
        self._num_cache_queried = 0

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, registry=r, buckets=buckets)

        self.ttft = hist("servelm_time_to_first_token_seconds", "Time to first token")
        self.tpot = hist("servelm_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request",
                         _TOKEN_LATENCY_BUCKETS)
        self.itl = hist("servelm_inter_token_latency_seconds",
                        "Time between consecutive tokens of a sequence", _TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("servelm_e2e_request_latency_seconds", "Arrival to last token")
        self.queue_time = hist("servelm_request_queue_time_seconds",
                               "Arrival to first scheduled step")
        self.prefill_time = hist("servelm_request_prefill_time_seconds",
                                 "Seconds of steps that computed the request's prompt")
        self.decode_time = hist("servelm_request_decode_time_seconds",
                                "First token to last token")
        self.finished = Counter("servelm_requests_finished_total",
                                "Requests the engine finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("servelm_requests_rejected_total",
                                "Requests refused before reaching the engine, by reason",
                                ["reason"], registry=r)
        self.http_responses = Counter("servelm_http_responses_total",
                                      "HTTP responses by status code", ["code"], registry=r)
        self.prompt_tokens = Counter("servelm_prompt_tokens_total",
                                     "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("servelm_generation_tokens_total",
                                         "Tokens generated", registry=r)
        self.reasoning_tokens = Counter("servelm_reasoning_tokens_total",
                                        "Completion tokens spent thinking (read by the "
                                        "reasoning parser)", registry=r)
        self.preemptions = Counter("servelm_preemptions_total",
                                   "Sequences preempted (KV dropped, recomputed later)",
                                   registry=r)
        self.running = Gauge("servelm_num_requests_running", "Requests with a running sequence",
                             registry=r)
        self.waiting = Gauge("servelm_num_requests_waiting",
                             "Requests admitted and not yet scheduled", registry=r)
        self.blocks_total = Gauge("servelm_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.blocks_used = Gauge("servelm_kv_blocks_used", "KV blocks held", registry=r)
        self.blocks_free = Gauge("servelm_kv_blocks_free", "KV blocks free", registry=r)
        self.kv_usage = Gauge("servelm_kv_cache_usage_ratio", "Used / total KV blocks",
                              registry=r)
        self.prefix_hit_rate = Gauge("servelm_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens "
                                     "(finished requests)", registry=r)
        self.prefix_hit_tokens = Counter("servelm_prefix_cache_hit_tokens_total",
                                         "Prompt tokens found in the prefix cache", registry=r)
        self.step_time = hist("servelm_step_time_seconds", "Wall time of one engine step",
                              _TOKEN_LATENCY_BUCKETS)
        self.step_batch = hist("servelm_step_batch_size", "Sequences per step", _COUNT_BUCKETS)
        self.step_tokens = hist("servelm_step_tokens", "Tokens computed per step",
                                _COUNT_BUCKETS)
        self.step_bw_util = hist("servelm_step_bandwidth_utilization",
                                 "Estimated bytes moved per second / peak bandwidth, per step",
                                 _RATIO_BUCKETS)
        self.step_flops_util = hist("servelm_step_compute_utilization",
                                    "Estimated FLOPs per second / peak FLOPs, per step",
                                    _RATIO_BUCKETS)
        self.bw_util = Gauge("servelm_bandwidth_utilization",
                             "Estimated bandwidth utilisation of the last step", registry=r)
        self.flops_util = Gauge("servelm_compute_utilization",
                                "Estimated compute utilisation of the last step", registry=r)
        self.step_bytes = Counter("servelm_step_bytes_total",
                                  "Estimated bytes moved by steps", registry=r)
        self.step_flops = Counter("servelm_step_flops_total", "Estimated FLOPs done by steps",
                                  registry=r)
        self.step_seconds = Counter("servelm_step_seconds_total", "Seconds spent in steps",
                                    registry=r)
        self.slo_met = Counter("servelm_requests_slo_met_total",
                               "Finished requests meeting both the TTFT and TPOT SLOs",
                               registry=r)
        self.slo_judged = Counter("servelm_requests_slo_judged_total",
                                  "Finished requests judged against the SLOs (not aborted)",
                                  registry=r)
        self.goodput = Gauge("servelm_goodput_ratio",
                             "Share of finished requests meeting the SLOs", registry=r)
        self._init_slo_classes(slo_spec, slo_ttft_s, slo_tpot_s)
        self.idempotent_replays = Counter(
            "servelm_idempotent_replays_total",
            "Requests answered by attaching to an earlier one with the same Idempotency-Key",
            registry=r)
        self.spec_proposed = Counter("servelm_spec_draft_tokens_total",
                                     "Draft tokens proposed and scored by the target",
                                     registry=r)
        self.spec_accepted = Counter("servelm_spec_accepted_tokens_total",
                                     "Draft tokens the target accepted", registry=r)
        self.spec_mean_len = Gauge("servelm_spec_mean_accepted_length",
                                   "Tokens per verifying sequence-step (accepted drafts + 1)",
                                   registry=r)
        self.spec_draft_share = Gauge("servelm_spec_draft_time_share",
                                      "Share of speculating steps' time spent drafting",
                                      registry=r)
        self.spec_k = Gauge("servelm_spec_draft_len",
                            "Draft tokens per sequence chosen for the last step (0: off)",
                            registry=r)
        self._spec_seen = (0, 0)
        self.spec_accepted_len = hist("servelm_spec_acceptance_length",
                                      "Drafts accepted per verifying sequence-step",
                                      _SPEC_LENGTH_BUCKETS)
        self.spec_position = Gauge("servelm_spec_position_acceptance_rate",
                                   "Share of verifications trying draft position N that "
                                   "accepted it", ["position"], registry=r)
        self._spec_lengths_seen: list[int] = []
        self.alive = Gauge("servelm_engine_alive", "1 while the engine loop runs", registry=r)
        info = Gauge("servelm_info", "Served model and peak numbers", ["model", "peak_bandwidth",
                                                                        "peak_flops"],
                     registry=r)
        info.labels(model_name, str(cost.peak_bandwidth if cost else ""),
                    str(cost.peak_flops if cost else "")).set(1)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        self.prefix_cache_namespaces = Gauge(
            "servelm_prefix_cache_namespaces",
            "Prefix-cache namespaces (cache_salt values) holding at least one block", registry=r)
        self.prefix_cache_bookkeeping_bytes = Gauge(
            "servelm_prefix_cache_bookkeeping_bytes",
            "Estimated bytes of the prefix cache's bookkeeping (tree nodes, token keys, "
            "namespace keys, LRU entries); bounded by the KV pool", registry=r)
        self.kv_tiers = KVTierMetrics(r)  # host memory / disk below the pool, per tier
        self.kv_transfer = DisaggMetrics(r)  # prefill/decode disaggregation's transfers
        self.connections = Gauge("servelm_http_connections",
                                 "Open HTTP connections", registry=r)

    def start_from(self, report) -> None:
        """Count from the engine's current totals (an engine may outlive one app)."""
        self._num_preemptions_seen = report.num_preemptions
        self._spec_seen = (report.spec_num_proposed, report.spec_num_accepted)
        self._spec_lengths_seen = list(report.spec_accepted_lengths)

    def observe_images(self, num_images: int) -> None:
        self.vision.observe_images(num_images)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- engine thread (in-process) or the core client's reader (engine core process) -----

    def observe_step(self, report, deltas: list[TokenDelta]) -> None:
        """One step's StepReport (servelm/core/contract.py) and the deltas it produced."""
        now = time.monotonic()
        if report.step_s is not None:
            bw, fl = self._observe_step_shape(report, report.step_s)
            self.recorder.add_step(StepRecord(
                now, report.step_s, report.last_num_seqs, report.last_num_tokens,
                report.last_max_prefill_chunk, sum(len(d.token_ids) for d in deltas),
                report.num_waiting_requests, bw, fl,
                report.num_used_blocks / report.num_total_blocks
                if report.num_total_blocks else 0.0))
        if report.num_preemptions > self._num_preemptions_seen:
            self.preemptions.inc(report.num_preemptions - self._num_preemptions_seen)
            self._num_preemptions_seen = report.num_preemptions
        if report.spec_k is not None:
            self._observe_spec(report)
        if report.kv_tiers:
            self.kv_tiers.observe_report(report.kv_tiers)
        if report.kv_transfer:
            self.kv_transfer.observe_report(report.kv_transfer)
        if report.num_images_encoded or report.num_encoder_cache_hits:
            self.vision.observe_report(report)
        for d in deltas:
            self._observe_delta(d, now)

    def _observe_spec(self, report) -> None:
        proposed, accepted = self._spec_seen
        if report.spec_num_proposed > proposed:
            self.spec_proposed.inc(report.spec_num_proposed - proposed)
        if report.spec_num_accepted > accepted:
            self.spec_accepted.inc(report.spec_num_accepted - accepted)
        self._spec_seen = (report.spec_num_proposed, report.spec_num_accepted)
        self.spec_mean_len.set(report.spec_mean_accepted_length)
        self.spec_draft_share.set(report.spec_draft_time_share)
        self.spec_k.set(report.spec_k)
        seen = self._spec_lengths_seen
        for n, count in enumerate(report.spec_accepted_lengths):
            for _ in range(count - (seen[n] if n < len(seen) else 0)):
                self.spec_accepted_len.observe(n)
        self._spec_lengths_seen = list(report.spec_accepted_lengths)
        for i, rate in enumerate(report.spec_position_acceptance):
            self.spec_position.labels(position=str(i + 1)).set(rate)

    def _observe_step_shape(self, stats, step_s: float) -> tuple[float | None, float | None]:
        """(bandwidth, compute) utilisation of the step; None without a cost model."""
        self.step_time.observe(step_s)
        self.step_batch.observe(stats.last_num_seqs)
        self.step_tokens.observe(stats.last_num_tokens)
        self.step_seconds.inc(step_s)
        if self.cost is None or step_s <= 0:
            return None, None
        nbytes, flops = self.cost.step_cost(stats)
        bw = nbytes / step_s / self.cost.peak_bandwidth
        fl = flops / step_s / self.cost.peak_flops
        self.step_bytes.inc(nbytes)
        self.step_flops.inc(flops)
        self.step_bw_util.observe(bw)
        self.step_flops_util.observe(fl)
        self.bw_util.set(bw)
        self.flops_util.set(fl)
        return bw, fl

    def _observe_delta(self, d: TokenDelta, now: float) -> None:
        key = (d.request_id, d.index)
        if d.token_ids:
            self.generation_tokens.inc(len(d.token_ids))
            last = self._last_token_time.get(key)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token_time[key] = now
        if d.finish_reason is not None:
            self._last_token_time.pop(key, None)
        if d.timings is not None:
            self._observe_request(d)

    def _observe_request(self, d: TokenDelta) -> None:
        t = d.timings
        reason = d.finish_reason.value if d.finish_reason else "abort"
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(d.num_prompt_tokens)
        for hist, value in ((self.ttft, t.ttft_s), (self.e2e, t.e2e_s),
                            (self.queue_time, t.queued_s)):
            if value is not None:
                hist.observe(value)
        if t.first_scheduled_time is not None:
            self.prefill_time.observe(t.prefill_time)
        tpot = None
        if t.first_token_time is not None and t.last_token_time is not None:
            self.decode_time.observe(t.last_token_time - t.first_token_time)
            if d.num_output_tokens > 1:
                tpot = (t.last_token_time - t.first_token_time) / (d.num_output_tokens - 1)
                self.tpot.observe(tpot)
        with self._lock:
            self._num_cached += t.num_cached_tokens
            self._num_cache_queried += d.num_prompt_tokens
            if self._num_cache_queried:
                self.prefix_hit_rate.set(self._num_cached / self._num_cache_queried)
            if t.num_cached_tokens:
                self.prefix_hit_tokens.inc(t.num_cached_tokens)
            if reason != "abort":
                self._num_slo_judged += 1
                self.slo_judged.inc()
                met = (t.ttft_s is not None and t.ttft_s <= self.slo_ttft_s
                       and (tpot is None or tpot <= self.slo_tpot_s))
                if met:
                    self._num_slo_met += 1
                    self.slo_met.inc()
                self.goodput.set(self._num_slo_met / self._num_slo_judged)
                self._observe_slo_class(d.request_id, t.ttft_s, tpot)
            else:
                self.request_classes.pop(d.request_id, None)

    def _init_slo_classes(self, spec, slo_ttft_s: float, slo_tpot_s: float) -> None:
        """Per SLO class (servelm/slo.py): goodput over the spec's sliding window, read at
        each scrape (the window moves with no new finishes), and the requests it counts."""
        from servelm.slo import SLOSpec, SlidingGoodput

        self.slo_spec = spec or SLOSpec.single(slo_ttft_s * 1e3, slo_tpot_s * 1e3)
        self.slo_window = SlidingGoodput(self.slo_spec)
        self.request_classes: dict[str, str] = {}  # engine request id -> class (serving.py)
        ratio = Gauge("servelm_slo_goodput_ratio", "Share of the requests finished in the "
                      "last window_s seconds meeting their class's TTFT and TPOT targets",
                      ["slo_class"], registry=self.registry)
        count = Gauge("servelm_slo_window_requests", "Requests finished in the last window_s "
                      "seconds", ["slo_class"], registry=self.registry)
        # A fleet's goodput is sum(met) / sum(requests) over its replicas, not a mean of ratios
        met = Gauge("servelm_slo_window_met_requests", "Requests finished in the last window_s "
                    "seconds that met both targets", ["slo_class"], registry=self.registry)
        for c in self.slo_spec.classes:
            ratio.labels(c.name).set_function(lambda n=c.name: self._window_goodput(n))
            count.labels(c.name).set_function(lambda n=c.name: self._window_count(n))
            met.labels(c.name).set_function(lambda n=c.name: self._window_met(n))

    def _window_goodput(self, name: str) -> float:
        with self._lock:
            value = self.slo_window.goodput(name, time.monotonic())
        return math.nan if value is None else value

    def _window_count(self, name: str) -> int:
        with self._lock:
            return self.slo_window.count(name, time.monotonic())

    def _window_met(self, name: str) -> int:
        with self._lock:
            return self.slo_window.num_met(name, time.monotonic())

    def _observe_slo_class(self, request_id: str, ttft_s, tpot_s) -> None:
        """Under self._lock, for a finished (not aborted) request."""
        name = self.request_classes.pop(request_id, self.slo_spec.default_class)
        self.slo_window.record(name, self.slo_spec.get(name).met(ttft_s, tpot_s),
                               time.monotonic())

    # -- event loop ------------------------------------------------------------------------

    def record_request(self, gen, endpoint: str, status: str, stream: bool,
                       trace_id: str | None = None) -> None:
        """One finished HTTP request's engine requests into the Recorder (the dashboard's
        waterfall, `servelm doctor`, traces). `gen`: generation.Generation."""
        from servelm.server.sse import current_stream_stats
        done = time.monotonic()
        stats = current_stream_stats() if stream else None
        submitted = getattr(gen, "submitted", None)
        trace_id = trace_id or self.recorder.trace_id()
        for i, r in enumerate(gen.requests):
            timings = gen.timings.get(r.request_id)
            num_out = sum(len(c.token_ids) for c in gen.choices[i * gen.n:(i + 1) * gen.n])
            self.recorder.add_request(build_record(
                self.recorder, r.request_id, endpoint=endpoint, status=status, stream=stream,
                arrival=gen.arrival, submitted=submitted, timings=timings,
                num_prompt_tokens=len(r.prompt_token_ids), num_output_tokens=num_out,
                done=done, stream_stats=stats, trace_id=trace_id))

    def refresh(self, async_engine) -> None:
        """Before a scrape: values the engine thread publishes, read without locking it."""
        snap = async_engine.snapshot
        self.alive.set(1 if async_engine.is_alive else 0)
        self.blocks_total.set(snap.num_total_blocks)
        self.blocks_used.set(snap.num_used_blocks)
        self.blocks_free.set(snap.num_free_blocks)
        if snap.num_total_blocks:
            self.kv_usage.set(snap.num_used_blocks / snap.num_total_blocks)
        self.running.set(snap.num_running_requests)
        self.waiting.set(async_engine.num_waiting)
        # From the engine's last StepReport (PrefixCache.usage()), in either process.
        self.prefix_cache_namespaces.set(snap.prefix_cache_namespaces)
        self.prefix_cache_bookkeeping_bytes.set(snap.prefix_cache_bytes)
