"""The autoscaler in virtual time: a fleet whose size the policy (servelm/autoscale) decides,
and the day-long diurnal workload to run it on.

Owns: `simulate_autoscaled` (the fleet simulation of fleet.py with replicas that boot for
`config.boot_s` before the router sees them, and that drain when removed: the router stops
sending them requests, they finish what they hold, then they go; nothing is dropped), the
signals a policy may be given (`tokens_in_flight`, `request_rate`, `utilization`), replica
time (paid from the order to start until retirement), and `diurnal_arrivals`.
Never: decides a size itself (policy.py does) or routes (servelm/router's policies do).

At each tick (every `config.tick_s`), over the serving replicas (ready, not draining):

    tokens_in_flight  the work the router counts in flight (routed_work): per request not
                      finished, its uncached prompt tokens + max_tokens; the same number
                      the real controller reads from the router
    request_rate      requests arrived in the last RATE_WINDOW_S / RATE_WINDOW_S
    utilization       busy seconds in the last tick / tick_s (a replica stepping all the
                      tick counts 1): what a CPU or GPU utilisation gauge reports

and, when the caller gives one, the batch backlog at that time (`batch`: a BatchDemand the
policy adds as the replicas its deadlines need; its lines use no simulated capacity).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from servelm.autoscale.policy import AutoscaleConfig, Autoscaler, BatchDemand
from servelm.bench.metrics import RequestRecord
from servelm.router.policies import RoutingPolicy
from servelm.sim.bulk import advance_decodes
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import (
    Replica,
    ReplicaSpec,
    SimRequest,
    _arrive,
    _make_replica,
    _step,
)

RATE_WINDOW_S = 60.0


@dataclass
class ScaleEvent:
    time_s: float
    delta: int
    num_replicas: int  # ready + booting after it
    signal: float
    reason: str


@dataclass
class FleetSample:
    time_s: float
    num_ready: int
    num_booting: int
    num_draining: int
    signal: float  # the policy's signal, fleet total
    arrival_rate: float  # requests / s over the last tick
    tokens_in_flight: float  # on serving replicas (whatever the policy's signal)


@dataclass
class AutoscaleResult:
    records: list[RequestRecord]
    events: list[ScaleEvent]
    timeline: list[FleetSample]
    replica_s: float  # replica time paid: from the start order to retirement
    elapsed_s: float
    wall_s: float
    max_replicas: int
    num_steps: int = 0


@dataclass
class _Member:
    rep: Replica
    ordered_s: float
    ready_s: float
    retired_s: float | None = None
    is_draining: bool = False
    busy_at_tick: float = 0.0


@dataclass
class _Fleet:
    spec: ReplicaSpec
    cost: StepCostModel
    started_s: float = 0.0
    members: list[_Member] = field(default_factory=list)
    count: itertools.count = field(default_factory=itertools.count)
    arrivals: deque = field(default_factory=deque)  # (tick time, requests in that tick)

    def arrival_rate(self, now: float, num_arrived: int) -> float:
        """Requests per second over the last RATE_WINDOW_S (as a Prometheus rate(...[1m])
        would read it; one tick's count is too noisy to scale on)."""
        self.arrivals.append((now, num_arrived))
        while self.arrivals and self.arrivals[0][0] <= now - RATE_WINDOW_S:
            self.arrivals.popleft()
        span = min(RATE_WINDOW_S, max(now - self.started_s, 1e-9))
        return sum(n for _, n in self.arrivals) / span

    def serving(self, now: float) -> list[_Member]:
        return [m for m in self.members if m.ready_s <= now and not m.is_draining
                and m.retired_s is None]

    def booting(self, now: float) -> list[_Member]:
        return [m for m in self.members if m.ready_s > now and m.retired_s is None]

    def draining(self) -> list[_Member]:
        return [m for m in self.members if m.is_draining and m.retired_s is None]

    def order(self, now: float, ready_s: float) -> _Member:
        m = _Member(_make_replica(next(self.count), self.spec, self.cost), now, ready_s)
        m.rep.clock.now = ready_s
        self.members.append(m)
        return m


def simulate_autoscaled(requests: Sequence[SimRequest], spec: ReplicaSpec,
                        cost: StepCostModel, routing: RoutingPolicy, config: AutoscaleConfig,
                        initial_replicas: int | None = None,
                        batch: Callable[[float], BatchDemand | None] | None = None
                        ) -> AutoscaleResult:
    """batch: the batch backlog at a virtual time, fed to the policy at each tick (a replay
    of a recorded backlog, or one written for the run); its lines use no simulated capacity."""
    started = time.perf_counter()
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    t0 = arrivals[0].arrival_s if arrivals else 0.0
    fleet = _Fleet(spec, cost, t0)
    for _ in range(initial_replicas or config.min_replicas):
        fleet.order(t0 - config.boot_s, t0)  # ready when the day starts
    scaler = Autoscaler(config, clock=lambda: now)
    slo = _SLOWindow(scaler.slo, arrivals) if scaler.slo is not None else None
    records: dict[str, RequestRecord] = {}
    steps: list = []
    order = itertools.count()
    events: list[ScaleEvent] = []
    timeline: list[FleetSample] = []
    now = t0
    next_tick = t0 + config.tick_s
    next_arrival = num_steps = 0
    arrived_at_tick = 0
    held: list[int] = []  # arrivals the router holds while no replica serves (min 0)
    inf = float("inf")
    while next_arrival < len(arrivals) or steps or held:
        t_arrive = arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) else inf
        t_step = steps[0][0] if steps else inf
        t_ready = min((m.ready_s for m in fleet.booting(now)), default=inf) if held else inf
        if t_ready <= min(t_arrive, t_step, next_tick):  # a replica for the held requests
            now = t_ready
            serving = [m.rep for m in fleet.serving(now)]
            for i in held:
                _arrive(f"r{i}", arrivals[i], serving, routing, records, steps, order)
            held = []
            continue
        if next_tick <= min(t_arrive, t_step):
            now = next_tick
            _retire_idle(fleet, now)
            sample, decision = _tick(fleet, scaler, config, now,
                                     next_arrival - arrived_at_tick,
                                     sum(_held_work(arrivals[i]) for i in held),
                                     slo.goodput(now) if slo is not None else None,
                                     batch(now) if batch is not None else None)
            arrived_at_tick = next_arrival
            timeline.append(sample)
            if decision.delta:
                _carry_out(fleet, decision.delta, now, config)
                events.append(ScaleEvent(now, decision.delta, decision.num_replicas,
                                         sample.signal, decision.reason))
            next_tick += config.tick_s
            continue
        if t_arrive <= t_step:
            now = t_arrive
            serving = fleet.serving(now)
            if not serving:  # scaled to zero (or every replica still booting): held
                if config.min_replicas >= 1 and not fleet.booting(now):
                    raise RuntimeError("no serving replica at an arrival")
                held.append(next_arrival)
                next_arrival += 1
                continue
            _arrive(f"r{next_arrival}", arrivals[next_arrival], [m.rep for m in serving],
                    routing, records, steps, order)
            next_arrival += 1
            continue
        t, _, rep = heapq.heappop(steps)
        now = t
        rep.clock.now = t
        n = advance_decodes(rep, min(t_arrive, next_tick), records)
        rep.changed()
        if n:
            num_steps += n
        else:
            finished = _step(rep, records)
            num_steps += 1
            if slo is not None:
                slo.finished(finished, records, rep.clock.now)
        if rep.engine.has_unfinished:
            heapq.heappush(steps, (rep.clock.now, next(order), rep))
        else:
            rep.is_stepping = False
    end = max((r.end_time for r in records.values() if r.end_time is not None), default=now)
    _retire_idle(fleet, end)
    replica_s = sum((m.retired_s if m.retired_s is not None else end) - m.ordered_s
                    for m in fleet.members if m.ordered_s < end)
    replica_s -= (initial_replicas or config.min_replicas) * config.boot_s  # booted pre-day
    peak = max((s.num_ready + s.num_booting for s in timeline),
               default=initial_replicas or config.min_replicas)
    return AutoscaleResult(list(records.values()), events, timeline, replica_s,
                           max(end - t0, 1e-9), time.perf_counter() - started, peak, num_steps)


def _signal(fleet: _Fleet, config: AutoscaleConfig, serving: list[_Member], now: float,
            num_arrived: int) -> tuple[float, float]:
    """(the policy's signal, tokens in flight) over the serving replicas."""
    tokens = float(sum(routed_work(m.rep) for m in serving))
    if config.signal == "tokens_in_flight":
        return tokens, tokens
    if config.signal == "request_rate":
        return fleet.arrival_rate(now, num_arrived), tokens
    busy = 0.0
    for m in serving:
        # A step in progress at `now` counts as busy up to now (the runner adds its whole
        # time when it starts).
        ahead = max(0.0, m.rep.clock.now - now) if m.rep.is_stepping else 0.0
        b = m.rep.runner.busy_s - ahead
        busy += min(config.tick_s, max(0.0, b - m.busy_at_tick))
        m.busy_at_tick = b
    return busy / config.tick_s, tokens


def routed_work(rep: Replica) -> int:
    """The work a router counts in flight on this replica (servelm/router/app.py): for each
    request not finished, its prompt tokens less those found cached, plus max_tokens."""
    sched = rep.engine.scheduler
    return sum(s.num_prompt_tokens - s.num_cached_tokens + s.max_tokens
               for s in (*sched.waiting, *sched.running))


def _held_work(req: SimRequest) -> int:
    """A held request's tokens, as the router counts them (prompt + max_tokens)."""
    return len(req.prompt_token_ids) + req.max_tokens


class _SLOWindow:
    """Each SLO class's goodput over the spec's window as a server's gauge reads it at a
    tick: requests count when their last token is out (a step's end), in time order."""

    def __init__(self, spec, arrivals: Sequence[SimRequest]):
        from servelm.slo import SlidingGoodput

        self.spec = spec
        self.window = SlidingGoodput(spec)
        self.classes = {f"r{i}": r.slo.slo_class if r.slo is not None and r.slo.slo_class
                        in spec.names else spec.default_class for i, r in enumerate(arrivals)}
        self._pending: list = []  # (finish time, tiebreak, class, met)
        self._order = itertools.count()

    def finished(self, rids: list[str], records: dict, end_s: float) -> None:
        for rid in rids:
            rec, name = records[rid], self.classes[rid]
            met = rec.is_ok and self.spec.get(name).met(rec.ttft_s, rec.tpot_s)
            heapq.heappush(self._pending, (end_s, next(self._order), name, met))

    def goodput(self, now: float) -> dict:
        while self._pending and self._pending[0][0] <= now:
            t, _, name, met = heapq.heappop(self._pending)
            self.window.record(name, met, t)
        return {c: (self.window.goodput(c, now), self.window.count(c, now))
                for c in self.spec.names}


def _tick(fleet: _Fleet, scaler: Autoscaler, config: AutoscaleConfig, now: float,
          num_arrived: int, held_tokens: int = 0, goodput: dict | None = None,
          batch: BatchDemand | None = None):
    serving = fleet.serving(now)
    signal, tokens = _signal(fleet, config, serving, now, num_arrived)
    if held_tokens and config.signal == "tokens_in_flight":
        signal, tokens = signal + held_tokens, tokens + held_tokens
    booting = fleet.booting(now)
    decision = scaler.decide(signal, len(serving), len(booting), goodput, batch)
    sample = FleetSample(now, len(serving), len(booting), len(fleet.draining()), signal,
                         num_arrived / config.tick_s, tokens)
    return sample, decision


def _carry_out(fleet: _Fleet, delta: int, now: float, config: AutoscaleConfig) -> None:
    if delta > 0:
        for _ in range(delta):
            fleet.order(now, now + config.boot_s)
        return
    n = -delta
    for m in sorted(fleet.booting(now), key=lambda m: -m.ready_s)[:n]:  # cancel boots first
        m.retired_s = now
        n -= 1
    # Then drain the least loaded serving replicas: the router sends them nothing more.
    serving = sorted(fleet.serving(now), key=lambda m: m.rep.load().num_tokens_in_flight)
    for m in serving[:n]:
        m.is_draining = True
    _retire_idle(fleet, now)


def _retire_idle(fleet: _Fleet, now: float) -> None:
    for m in fleet.draining():
        if not m.rep.engine.has_unfinished:
            m.retired_s = max(now, m.rep.clock.now)


# -- the workload -------------------------------------------------------------------------

# A day's shape: the rate as a share of the peak at each hour, trough at 04:00, crest at
# 16:00 (0.7 of the peak), and three spikes (start hour, hours, added share of the peak).
SPIKES = ((10.0, 0.5, 0.45), (15.75, 0.5, 0.3), (20.5, 0.5, 0.35))


def diurnal_share(hour: float) -> float:
    h = hour % 24
    share = 0.1 + 0.6 * (0.5 - 0.5 * math.cos(2 * math.pi * (h - 4) / 24))
    for start, length, extra in SPIKES:
        if start <= h < start + length:
            share += extra
    return share


def diurnal_arrivals(peak_rate: float, hour_s: float, seed: int = 0,
                     hours: float = 24.0) -> np.ndarray:
    """Send times over `hours` of the day shape, each hour lasting `hour_s` seconds, the
    rate `peak_rate x diurnal_share(hour)`: a Poisson process by thinning."""
    if not 0 < peak_rate < math.inf:
        raise ValueError(f"--request-rate: the diurnal peak must be positive, got {peak_rate}")
    if not 0 < hour_s < math.inf:
        raise ValueError(f"--hour-s: must be positive, got {hour_s}")
    rng = np.random.default_rng(seed)
    span = hours * hour_s
    peak = peak_rate * max(diurnal_share(h / 4) for h in range(24 * 4 * 2))
    n = rng.poisson(peak * span)
    t = np.sort(rng.uniform(0, span, size=n))
    keep = rng.uniform(0, peak, size=n) < peak_rate * np.array(
        [diurnal_share(x / hour_s) for x in t])
    return t[keep]


# The evening's users ask for longer answers: the same request rate is more work, which a
# policy on request rate does not see.
LONG_HOURS = (18.0, 23.0)
LONG_OUTPUT_FACTOR = 2


def diurnal_requests(peak_rate: float, hour_s: float, input_len, output_len,
                     vocab_size: int, seed: int = 0) -> list[SimRequest]:
    """A day (diurnal_arrivals) of random-length requests, answers LONG_OUTPUT_FACTOR x
    longer in LONG_HOURS."""
    from servelm.bench.workloads import random_lengths

    times = diurnal_arrivals(peak_rate, hour_s, seed)
    reqs = random_lengths(len(times), input_len, output_len, vocab_size, seed)
    out = []
    for t, r in zip(times, reqs):
        is_long = LONG_HOURS[0] <= t / hour_s < LONG_HOURS[1]
        out.append(SimRequest(float(t), r.prompt_token_ids,
                              r.max_tokens * (LONG_OUTPUT_FACTOR if is_long else 1)))
    return out


__all__ = ["AutoscaleResult", "FleetSample", "ScaleEvent", "diurnal_arrivals",
           "diurnal_requests", "diurnal_share", "simulate_autoscaled"]
