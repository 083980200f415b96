"""The load generator of `servelm bench serve`: arrivals, streaming requests, client overhead.

Owns: arrival_offsets (Poisson, constant, bursts), the OpenAI streaming request and its
per-token timing (stream_request), the event-loop lag sampler, and run_load (open-loop at a
request rate, or closed-loop at a fixed concurrency; warm-up; bounded by count or duration).
Never: computes percentiles (metrics.py) or talks to anything but the URL it is given.

Honesty of the client: one httpx.AsyncClient whose pool holds as many connections as can be in
flight, so a request never waits for a connection; each record keeps when it was scheduled,
sent and fully written, and a sampler measures how late the event loop wakes up. A client
that is the bottleneck shows up there (client.send_delay_ms, write_ms, loop_lag_ms).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from servelm.bench.metrics import RequestRecord
from servelm.bench.workloads import Request, prompt_text

ARRIVALS = ("poisson", "constant", "burst")
ERROR_DETAIL_LEN = 300


def arrival_offsets(num: int, rate: float, kind: str = "poisson", *, burst_size: int = 8,
                    seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of `num` requests at a mean of `rate` per second.

    poisson   exponential gaps with mean 1/rate (memoryless users)
    constant  gaps of exactly 1/rate
    burst     groups of `burst_size` requests sent together, the groups Poisson with mean
              gap burst_size/rate (so the mean rate is still `rate`)
    rate = inf sends everything at once (a batch). The first request goes at 0.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if kind not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {kind!r}")
    if math.isinf(rate) or num == 0:
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    if kind == "constant":
        return np.arange(num) / rate
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=num)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1, got {burst_size}")
    num_bursts = -(-num // burst_size)
    gaps = rng.exponential(burst_size / rate, size=num_bursts)
    gaps[0] = 0.0
    return np.repeat(np.cumsum(gaps), burst_size)[:num]


@dataclass(frozen=True)
class EndpointConfig:
    """How to talk to one OpenAI-compatible server."""

    base_url: str
    model: str
    api_key: str | None = None
    endpoint: str = "completions"  # or "chat" (text only)
    prompt_format: str = "ids"  # "ids": prompt as token ids; "text": words from the ids
    ignore_eos: bool = True  # with min_tokens = max_tokens, so lengths are as requested
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return self.base_url.rstrip("/") + ("" if self.base_url.rstrip("/").endswith("/v1")
                                            else "/v1") + "/" + path

    def body(self, req: Request) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt_text(req.prompt_token_ids)}]
        elif self.prompt_format == "text":
            body["prompt"] = prompt_text(req.prompt_token_ids)
        else:
            body["prompt"] = list(req.prompt_token_ids)
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = req.max_tokens
        slo_class = getattr(req, "slo_class", None)  # a ClassRequest (bench/serve.py)
        if slo_class is not None:
            body["slo_class"] = slo_class
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_client(cfg: EndpointConfig, max_connections: int):
    """The one shared client: a pool as large as the most requests in flight."""
    import httpx

    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=cfg.headers(),
                             trust_env=False)


def _fail(rec: RequestRecord, kind: str, detail: str) -> None:
    rec.error = kind
    rec.error_detail = detail[:ERROR_DETAIL_LEN]
    rec.end_time = None


def _chunk_has_token(data: dict[str, Any], is_chat: bool) -> bool:
    choices = data.get("choices") or []
    if not choices:
        return False
    if is_chat:
        return bool((choices[0].get("delta") or {}).get("content"))
    # One completion chunk per token step, even where its text is still empty (a held-back
    # partial character); but an empty chunk that only carries the finish reason closes the
    # stream (llama-cpp-python sends one) and is not a token.
    return bool(choices[0].get("text")) or not choices[0].get("finish_reason")


def _on_event(rec: RequestRecord, payload: str, is_chat: bool, now: float) -> bool:
    """Handle one SSE data payload; True at [DONE]. Raises ValueError on a bad event."""
    if payload == "[DONE]":
        return True
    data = json.loads(payload)
    if not isinstance(data, dict):
        raise ValueError(f"event is not an object: {payload[:80]}")
    if data.get("error"):
        raise ValueError(f"error event: {json.dumps(data['error'])}")
    if _chunk_has_token(data, is_chat):
        if rec.first_token_time is None:
            rec.first_token_time = now
        rec.chunk_times.append(now)
    usage = data.get("usage")
    if usage:
        rec.has_usage = True
        rec.num_output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            rec.usage_prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    return False


async def stream_request(client, cfg: EndpointConfig, req: Request,
                         rec: RequestRecord) -> RequestRecord:
    """Send one streaming request and fill `rec` with its timings or its failure kind:
    http_<status>, timeout, connection (nothing came back) or stream (a broken stream)."""
    import httpx

    async def trace(name: str, info: dict) -> None:
        if name == "http11.send_request_body.complete":
            rec.written_time = time.perf_counter()

    is_chat = cfg.endpoint == "chat"
    rec.sent_time = time.perf_counter()
    has_response = False
    try:
        async with client.stream("POST", cfg.url, json=cfg.body(req),
                                 extensions={"trace": trace}) as resp:
            has_response = True
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                _fail(rec, f"http_{resp.status_code}", body)
                return rec
            is_done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if _on_event(rec, line[5:].strip(), is_chat, time.perf_counter()):
                    is_done = True
                    break
            rec.end_time = time.perf_counter()
            if not is_done:
                _fail(rec, "stream", "stream ended without [DONE]")
            elif rec.first_token_time is None:
                _fail(rec, "stream", "no token in the stream")
            elif not rec.has_usage:
                rec.num_output_tokens = len(rec.chunk_times)
    except httpx.TimeoutException as e:
        _fail(rec, "timeout", f"{type(e).__name__}: {e}")
    except (httpx.TransportError, httpx.StreamError) as e:
        _fail(rec, "stream" if has_response else "connection", f"{type(e).__name__}: {e}")
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        # Bad JSON, an error event, or chunks of the wrong shape: this request's stream is
        # broken; the run goes on.
        _fail(rec, "stream", f"{type(e).__name__}: {e}")
    return rec


class LoopLagSampler:
    """How late the event loop wakes from a short sleep: a busy client delays every
    timestamp it takes by about this much."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, time.perf_counter() - t - self.interval_s))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


@dataclass
class LoadSpec:
    """What traffic to send. Exactly one of request_rate and concurrency is set."""

    request_rate: float | None = None  # requests/s (inf: all at once)
    concurrency: int | None = None
    arrival: str = "poisson"
    burst_size: int = 8
    duration_s: float | None = None  # stop sending after this; None: send every request
    max_concurrency: int | None = None  # cap in open loop (requests beyond it wait, counted)
    seed: int = 0

    def __post_init__(self):
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of request_rate and concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


@dataclass
class LoadResult:
    records: list[RequestRecord]
    elapsed_s: float
    loop_lag_s: list[float]
    num_warmup_failed: int = 0


def _progress(total: int | None, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


async def _open_loop(client, cfg, requests, spec, bar) -> list[RequestRecord]:
    offsets = arrival_offsets(len(requests), spec.request_rate, spec.arrival,
                              burst_size=spec.burst_size, seed=spec.seed)
    gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    records: list[RequestRecord] = []
    tasks = []

    async def one(req: Request, rec: RequestRecord) -> None:
        if gate is None:
            await stream_request(client, cfg, req, rec)
        else:
            async with gate:
                await stream_request(client, cfg, req, rec)
        bar.update(1)

    t0 = time.perf_counter()
    for req, offset in zip(requests, offsets):
        if spec.duration_s is not None and offset > spec.duration_s:
            break
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(len(req.prompt_token_ids), req.max_tokens,
                            scheduled_time=t0 + offset)
        records.append(rec)
        tasks.append(asyncio.create_task(one(req, rec)))
    await asyncio.gather(*tasks)
    return records


async def _closed_loop(client, cfg, requests, spec, bar) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_index = 0
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(requests):
            if spec.duration_s is not None and time.perf_counter() - t0 > spec.duration_s:
                return
            req = requests[next_index]
            next_index += 1
            rec = RequestRecord(len(req.prompt_token_ids), req.max_tokens,
                                scheduled_time=time.perf_counter())
            records.append(rec)
            await stream_request(client, cfg, req, rec)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    return records


async def _warmup(client, cfg, requests: Sequence[Request], width: int) -> int:
    """Send the warm-up requests (not measured); returns how many failed."""
    gate = asyncio.Semaphore(max(1, width))

    async def one(req: Request) -> RequestRecord:
        async with gate:
            return await stream_request(client, cfg, req, RequestRecord(0, req.max_tokens))

    done = await asyncio.gather(*(one(r) for r in requests))
    return sum(not r.is_ok for r in done)


async def run_load_async(cfg: EndpointConfig, requests: Sequence[Request], spec: LoadSpec, *,
                         warmup: Sequence[Request] = (), progress: bool = False) -> LoadResult:
    if spec.concurrency is not None:
        pool = spec.concurrency
    else:
        pool = spec.max_concurrency or max(1, len(requests))
    async with make_client(cfg, pool) as client:
        num_warmup_failed = 0
        if warmup:
            num_warmup_failed = await _warmup(client, cfg, warmup, min(pool, len(warmup)))
            if num_warmup_failed == len(warmup):
                rec = await stream_request(client, cfg, warmup[0],
                                           RequestRecord(0, warmup[0].max_tokens))
                raise ConnectionError(f"every warm-up request to {cfg.url} failed; last: "
                                      f"{rec.error}: {rec.error_detail}")
        lag = LoopLagSampler()
        lag.start()
        total = None if spec.duration_s is not None else len(requests)
        with _progress(total, progress) as bar:
            start = time.perf_counter()
            if spec.concurrency is not None:
                records = await _closed_loop(client, cfg, requests, spec, bar)
            else:
                records = await _open_loop(client, cfg, requests, spec, bar)
            end = max([start] + [r.end_time for r in records if r.end_time is not None]
                      + [time.perf_counter() if any(not r.is_ok for r in records) else start])
        await lag.stop()
    return LoadResult(records, max(end - start, 1e-9), lag.lags_s, num_warmup_failed)


def run_load(cfg: EndpointConfig, requests: Sequence[Request], spec: LoadSpec, *,
             warmup: Sequence[Request] = (), progress: bool = False) -> LoadResult:
    """Drive the endpoint with `requests` as `spec` says and return what was measured."""
    return asyncio.run(run_load_async(cfg, requests, spec, warmup=warmup, progress=progress))
