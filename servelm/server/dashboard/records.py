"""The per-request and per-step records behind the dashboard, the doctor and the traces.

Owns: `StepRecord` (one engine step as the front end saw it: when it ended, how long it took,
its shape, the largest prefill chunk in it, estimated bandwidth / compute utilisation),
`RequestRecord` (where one request's time went: host work before it reached the engine, queue,
prefill, time lost to other requests' work, decode, time blocked on the client's socket, GC
pauses, plus the prefill chunks it waited behind), the `Recorder` that keeps a bounded window
of both, and the JSON-lines form `servelm doctor --log` reads.
Never: blocks the engine thread (appends under a short lock), imports FastAPI or torch, or
keeps more than its bounded windows.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

RECORD_VERSION = 1
KV_FULL = 0.9  # a pool this full turns new requests away (the scheduler keeps a reserve)


class StepRecord(NamedTuple):
    end: float  # time.monotonic() when the front end saw the step's report
    step_s: float
    num_seqs: int
    num_tokens: int
    max_chunk: int  # largest prefill (or recompute) chunk of one sequence in the step
    num_generated: int  # tokens the step emitted
    num_waiting: int  # requests waiting after the step
    bandwidth_util: float | None
    compute_util: float | None
    kv_usage: float = 0.0  # used / total KV blocks after the step

    @property
    def start(self) -> float:
        return self.end - self.step_s


@dataclass
class RequestRecord:
    """One engine request (one prompt of an HTTP request). Seconds; None: never reached."""

    request_id: str
    endpoint: str
    status: str
    stream: bool
    arrival: float  # time.monotonic() at the front end
    arrival_unix: float  # the same instant, wall clock (for logs read elsewhere)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    host_s: float | None = None  # arrival -> handed to the engine (parse, template, tokenize)
    queue_s: float | None = None  # handed to the engine -> first scheduled step
    prefill_s: float | None = None  # steps that computed this prompt
    prefill_wait_s: float | None = None  # scheduled -> first token, not its own prompt steps
    ttft_s: float | None = None  # arrival -> first token (engine clock, as /metrics counts)
    decode_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None  # arrival -> last token
    latency_s: float | None = None  # arrival -> the front end was done (last byte written)
    delivery_lag_s: float | None = None  # first token made -> first token written (streams)
    client_blocked_s: float = 0.0  # awaiting socket writes (a slow reader)
    gc_s: float = 0.0  # front-end GC pauses during the request
    max_chunk_waited: int = 0  # largest other sequence's prefill chunk in a step before TTFT
    behind_chunks_s: float = 0.0  # of arrival -> first token, in steps with such a chunk
    max_kv_usage_waited: float = 0.0  # highest KV usage seen between arrival and first token
    queue_kv_full_s: float = 0.0  # of its queue time, in steps that left the KV pool >= 90% full
    decode_max_chunk: int = 0  # largest prefill chunk in a step between first and last token
    decode_prefill_s: float = 0.0  # of its decode time, in steps that also computed a prefill
    num_steps_before_first_token: int = 0
    num_waiting_at_arrival: int = 0
    max_num_batched_tokens: int | None = None  # the engine's step budget, when known
    trace_id: str | None = None

    def to_json(self) -> str:
        return json.dumps({"v": RECORD_VERSION, "kind": "request", **asdict(self)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("request_id", "arrival", "num_prompt_tokens") if n not in d]
        if missing:
            raise ValueError(f"request record lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def phases(self) -> dict[str, float]:
        """The waterfall: consecutive spans from arrival (seconds each, None as 0)."""
        return {"host": self.host_s or 0.0, "queue": self.queue_s or 0.0,
                "prefill": self.prefill_s or 0.0, "stall": self.prefill_wait_s or 0.0,
                "decode": self.decode_s or 0.0,
                "client": max(0.0, (self.latency_s or 0.0) - (self.e2e_s or 0.0))}


class GCMonitor:
    """Front-end garbage-collection pauses (gc.callbacks), kept as (start, end) pairs; one
    per process (`gc_monitor()`)."""

    def __init__(self, maxlen: int = 4096):
        self.pauses: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self._start: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.monotonic()
        elif self._start is not None:
            self.pauses.append((self._start, time.monotonic()))
            self._start = None

    def paused_between(self, start: float, end: float) -> float:
        total = 0.0
        for a, b in reversed(list(self.pauses)[-256:]):  # recent pauses; the newest last
            if b <= start:
                break
            total += max(0.0, min(b, end) - max(a, start))
        return total



_GC_MONITOR: GCMonitor | None = None


def gc_monitor() -> GCMonitor:
    global _GC_MONITOR
    if _GC_MONITOR is None:
        _GC_MONITOR = GCMonitor()
    return _GC_MONITOR


class Recorder:
    """Bounded windows of steps and finished requests, appended from the engine thread (steps)
    and the event loop (requests); optionally each request record appended to a JSON-lines
    file as it finishes (`--request-log`)."""

    def __init__(self, max_steps: int = 20000, max_requests: int = 5000,
                 log_path: str | None = None, max_num_batched_tokens: int | None = None):
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gc = gc_monitor()
        self._lock = threading.Lock()
        self._log = None
        if log_path:
            self.open_log(log_path)
        self.num_requests = 0
        self.listeners: list = []  # called with each finished RequestRecord (tracing)
        self.trace_id = lambda: None  # the current request's trace id (servelm.tracing)

    def open_log(self, path: str) -> None:
        """Append each finished request's record to `path` (JSON lines)."""
        try:
            self._log = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"request_log: cannot open {path}: {exc.strerror}") from None

    def add_step(self, step: StepRecord) -> None:
        with self._lock:
            self.steps.append(step)

    def steps_between(self, start: float, end: float) -> list[StepRecord]:
        """Steps overlapping [start, end], oldest first. Steps arrive in order, so this walks
        back from the newest only as far as `start` (a request's lifetime, not the window)."""
        out = []
        with self._lock:
            for s in reversed(self.steps):
                if s.end <= start:
                    break
                if s.start < end:
                    out.append(s)
        out.reverse()
        return out

    def waiting_at(self, t: float) -> int:
        """Requests waiting after the last step that ended before `t`."""
        with self._lock:
            for s in reversed(self.steps):
                if s.end <= t:
                    return s.num_waiting
        return 0

    def add_request(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)
            self.num_requests += 1
        if self._log is not None:
            self._log.write(rec.to_json() + "\n")
        for listener in self.listeners:
            listener(rec)

    def recent_requests(self, window_s: float | None = None) -> list[RequestRecord]:
        with self._lock:
            recs = list(self.requests)
        if window_s is None:
            return recs
        horizon = time.monotonic() - window_s
        return [r for r in recs if r.arrival + (r.latency_s or 0.0) >= horizon]

    def recent_steps(self, window_s: float | None = None) -> list[StepRecord]:
        with self._lock:
            steps = list(self.steps)
        if window_s is None:
            return steps
        horizon = time.monotonic() - window_s
        return [s for s in steps if s.end >= horizon]

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def build_record(recorder: Recorder, request_id: str, *, endpoint: str, status: str,
                 stream: bool, arrival: float, submitted: float | None, timings,
                 num_prompt_tokens: int, num_output_tokens: int, done: float,
                 stream_stats=None, trace_id: str | None = None) -> RequestRecord:
    """A finished request's record from its RequestTimings (engine clock: time.monotonic,
    shared by the core process on one machine) and what the front end measured."""
    rec = RequestRecord(request_id, endpoint, status, stream, arrival,
                        time.time() - (time.monotonic() - arrival), num_prompt_tokens,
                        num_output_tokens, latency_s=done - arrival,
                        max_num_batched_tokens=recorder.max_num_batched_tokens,
                        trace_id=trace_id)
    rec.gc_s = recorder.gc.paused_between(arrival, done)
    rec.num_waiting_at_arrival = recorder.waiting_at(arrival)
    if submitted is not None:
        rec.host_s = max(0.0, submitted - arrival)
    if stream_stats is not None:
        rec.client_blocked_s = stream_stats.blocked_s
    if timings is None:
        return rec
    rec.num_cached_tokens = timings.num_cached_tokens
    rec.num_preemptions = timings.num_preemptions
    if timings.first_scheduled_time is not None:
        scheduled = timings.first_scheduled_time
        rec.queue_s = max(0.0, scheduled - (submitted or arrival))
        rec.prefill_s = timings.prefill_time
        rec.queue_kv_full_s = sum(
            min(s.end, scheduled) - max(s.start, arrival)
            for s in recorder.steps_between(arrival, scheduled) if s.kv_usage >= KV_FULL)
    rec.ttft_s = timings.ttft_s
    rec.e2e_s = timings.e2e_s
    first, last = timings.first_token_time, timings.last_token_time
    if first is not None:
        if timings.first_scheduled_time is not None:
            rec.prefill_wait_s = max(0.0, first - timings.first_scheduled_time
                                     - timings.prefill_time)
        own = num_prompt_tokens - timings.num_cached_tokens
        window = recorder.steps_between(arrival, first)
        rec.num_steps_before_first_token = len(window)
        # A chunk larger than this request's own uncached prompt was someone else's.
        others = [s for s in window if s.max_chunk > own]
        rec.max_chunk_waited = max((s.max_chunk for s in others), default=0)
        rec.behind_chunks_s = sum(min(s.end, first) - max(s.start, arrival) for s in others)
        rec.max_kv_usage_waited = max((s.kv_usage for s in window), default=0.0)
        if stream_stats is not None:
            written = stream_stats.first_write_after(first)
            if written is not None:
                rec.delivery_lag_s = max(0.0, written - first)
        if last is not None:
            rec.decode_s = last - first
            if num_output_tokens > 1:
                rec.tpot_s = rec.decode_s / (num_output_tokens - 1)
            # The steps that made its tokens after the first (each ends with one of them).
            decoding = [s for s in recorder.steps_between(first, last)
                        if s.end > first + 1e-6 and s.max_chunk > 0]
            rec.decode_max_chunk = max((s.max_chunk for s in decoding), default=0)
            rec.decode_prefill_s = sum(min(s.end, last) - max(s.start, first) for s in decoding)
    return rec


def read_log(lines) -> tuple[list[RequestRecord], list[dict]]:
    """Request records (and any other records, e.g. a config line) from JSON lines."""
    requests, other = [], []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {i}: not JSON ({exc})") from None
        if not isinstance(d, dict):
            raise ValueError(f"line {i}: not a JSON object")
        if d.get("kind", "request") == "request":
            d.pop("v", None), d.pop("kind", None)
            try:
                requests.append(RequestRecord.from_dict(d))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"line {i}: {exc}") from None
        else:
            other.append(d)
    return requests, other
