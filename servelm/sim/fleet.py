"""The discrete-event simulation of a fleet: N replicas, each the real Engine, Scheduler,
BlockManager and PrefixCache on a SimRunner, behind a routing policy.

Owns: the event queue (arrivals and step completions in virtual time), per-request records
in the shape `servelm bench serve` measures (so the result is its JSON schema), and each
replica's KV usage and queue length over time.
Never: models a policy of its own: scheduling, admission, preemption and prefix hits are the
engine's; routing is servelm/router's.

Time: each replica has a VirtualClock. A replica with work runs one step at a time; a step
starting at t ends at t + cost(step), when its tokens are stamped (first token, chunks,
finish). A request that arrives during a step waits for the next one, as on a server.
Arrivals at the same instant as a step's start are admitted before it. Steps in which
nothing changes but one token per running sequence are run in bulk (servelm/sim/bulk.py),
which gives exactly what stepping gives (tests/sim/test_bulk.py); `bulk=False` steps each.
A fleet whose prompts can never hit a prefix cache runs without them until a preemption,
when it is run again with them (simulate, _cache_never_hit: the same result, faster).
"""

from __future__ import annotations

import copy
import gc
import heapq
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from servelm.bench.metrics import RequestRecord
from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.engine.slo_policy import SLOUnattainableError
from servelm.protocol import EngineRequest, RequestSLO, SamplingParams
from servelm.router.policies import ReplicaLoad, RouteRequest, RoutingPolicy
from servelm.sim.bulk import DecodeHead, advance_decodes, finish_run, mixed_step
from servelm.sim.cost_model import StepCostModel, StepShape
from servelm.sim.runner import SimRunner, VirtualClock



@dataclass(frozen=True)
class ReplicaSpec:
    """What each simulated replica is: its KV pool and scheduler limits."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    vocab_size: int = 49152
    eos_token_ids: tuple[int, ...] = (0,)
    scheduling_policy: str = "fcfs"  # SchedulerConfig.scheduling_policy


@dataclass
class SimRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    slo: RequestSLO | None = None  # its SLO class's targets (servelm/slo.py), as a server sends


@dataclass
class Replica:
    index: int
    engine: Engine
    clock: VirtualClock
    runner: SimRunner
    is_stepping: bool = False
    last_finish: float | None = None  # when the last step finished a request, if it did
    num_mixed_steps: int = 0  # engine steps run with the decode head lazy (bulk.mixed_step)
    # The lazily advanced head of the running list (bulk.DecodeHead): its sequences and
    # records are caught up as they leave it, or all at once by bulk.finish_run.
    decode_head: DecodeHead | None = None
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)
    # (time, kv usage, waiting, running) after each step
    # load() less the prompt's cached tokens, kept until the engine's state changes: a
    # replica is read at every arrival but changes only when it steps or takes a request.
    _load: ReplicaLoad | None = None
    # the fleet's set of replicas whose load changed since routing last read them (an
    # incremental routing index's), or None
    _dirty: set | None = None

    def changed(self) -> None:
        """The engine's queues or blocks moved (a step, a bulk advance, a new request)."""
        self._load = None
        if self._dirty is not None:
            self._dirty.add(self.index)

    def load(self, prompt: list[int] | None = None) -> ReplicaLoad:
        """This replica's load, and how much of `prompt` its prefix cache holds (exact: the
        simulator reads the cache a router would estimate from KV events)."""
        bm = self.engine.block_manager
        base = self._load
        if base is None:
            sched = self.engine.scheduler
            in_flight = sum(s.num_uncomputed_tokens for s in sched.waiting)
            head = self.decode_head
            if head is None or not head.seqs:
                in_flight += sum(s.max_tokens - s.num_output_tokens for s in sched.running)
            else:  # the head's sequences are not caught up: it counts their tokens
                in_flight += head.in_flight + sum(s.max_tokens - s.num_output_tokens
                                                  for s in sched.running[len(head.seqs):])
            base = self._load = ReplicaLoad(len(sched.waiting), len(sched.running), in_flight,
                                            bm.num_used_blocks / bm.num_blocks, True, 0)
        if prompt is None or bm.prefix_cache is None:
            return base
        cached = bm.prefix_cache.match(prompt, None, len(prompt) - 1, record=False).num_tokens
        return base._replace(cached_tokens=cached) if cached else base


@dataclass
class SimResult:
    records: list[RequestRecord]
    replicas: list[Replica]
    elapsed_s: float  # virtual: first arrival -> last finish
    wall_s: float
    num_steps: int
    num_bulk_steps: int = 0  # of num_steps, those advanced in bulk (plain decodes)
    num_mixed_steps: int = 0  # of num_steps, engine steps whose leading decodes were hidden

    @property
    def requests_per_wall_s(self) -> float:
        return len(self.records) / self.wall_s if self.wall_s > 0 else float("inf")


def _make_replica(index: int, spec: ReplicaSpec, cost: StepCostModel) -> Replica:
    clock = VirtualClock()
    runner = SimRunner(cost, clock, spec.vocab_size, spec.eos_token_ids)
    engine = Engine(runner, None,
                    BlockManager(spec.num_blocks, spec.block_size, spec.enable_prefix_caching),
                    SchedulerConfig(spec.max_num_batched_tokens, spec.max_num_seqs,
                                    spec.enable_chunked_prefill,
                                    scheduling_policy=spec.scheduling_policy),
                    spec.max_model_len, spec.vocab_size, spec.eos_token_ids, clock=clock)
    if engine.scheduler.policy is not None:  # the SLO policy predicts with the same model
        engine.scheduler.policy.step_time = step_time_of(cost)
    return Replica(index, engine, clock, runner)


def step_time_of(cost) -> Callable[[int, int, int, int, int], float]:
    """A cost model's prediction over a step shape's five numbers (slo_policy.StepTime)."""
    own = getattr(cost, "step_time", None)
    return own if own is not None else (lambda *shape: cost.predict(StepShape(*shape)))


def simulate(requests: Sequence[SimRequest], num_replicas: int, spec: ReplicaSpec,
             cost: StepCostModel, policy: RoutingPolicy, bulk: bool = True,
             skip_idle_cache: bool = True) -> SimResult:
    """Run every request to completion; returns what a client would have measured.
    bulk: run plain decode steps in bulk (the same result, faster).
    skip_idle_cache: leave the replicas' prefix caches out while no admission could hit
    them (the same result, faster; see _cache_never_hit).

    Python's cyclic garbage collector is off while it runs (and restored after): the
    simulation builds millions of long-lived objects (prefix-cache nodes, records) and
    frees what it drops by reference counting alone, so the collector's passes over the
    live objects found nothing and were a large share of the time (tests/sim/test_bulk.py
    checks that a run leaves no cyclic garbage behind while its result is alive)."""
    started = time.perf_counter()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if skip_idle_cache and spec.enable_prefix_caching \
                and _cache_never_hit(requests, spec.block_size):
            try:  # a copy of the policy: a restart must find it as it was (RoundRobin's turn)
                return _simulate(requests, num_replicas,
                                 replace(spec, enable_prefix_caching=False), cost,
                                 copy.deepcopy(policy), bulk, started, stop_on_preempt=True)
            except _CacheNeeded:
                pass  # a preempted sequence would hit its own cached blocks: run with them
        return _simulate(requests, num_replicas, spec, cost, policy, bulk, started)
    finally:
        if was_enabled:
            gc.enable()


class _CacheNeeded(Exception):
    """A run without prefix caches reached its first preemption (simulate restarts it)."""


def _cache_never_hit(requests: Sequence[SimRequest], block_size: int) -> bool:
    """Whether, short of preemption, no admission can hit a replica's prefix cache: every
    prompt fills its first block, and no two prompts' first blocks are equal.

    A match starts at a prompt's first block, so it can then only find the sequence's own
    blocks, which are cached only after its admission: the one way back to them is a
    preempted sequence's re-admission. Until a preemption, then, every match finds
    nothing, and a cache changes no count the scheduler reads (its cached-only blocks count
    as free, the free list is taken before them), nor the routing (its cached tokens are
    0), the KV usage or the hit rate (0): a run without it takes the same steps (the
    sequences are n = 1 and unsalted, one namespace). It only saves filing ~144 cache
    nodes per 2,000-token request. tests/sim/test_speed.py checks the equality, and that
    a run with a preemption is restarted with the caches."""
    firsts = set()
    for r in requests:
        ids = r.prompt_token_ids
        if len(ids) < block_size:  # its first block would hold generated tokens too
            return False
        first = hash(tuple(ids[:block_size]))  # equal hashes of unequal blocks: no harm,
        if first in firsts:  # the cache is kept
            return False
        firsts.add(first)
    return True


def _simulate(requests: Sequence[SimRequest], num_replicas: int, spec: ReplicaSpec,
              cost: StepCostModel, policy: RoutingPolicy, bulk: bool, started: float,
              stop_on_preempt: bool = False) -> SimResult:
    """stop_on_preempt: raise _CacheNeeded at the first preemption (simulate's first try
    without prefix caches)."""
    replicas = [_make_replica(i, spec, cost) for i in range(num_replicas)]
    lag = getattr(cost, "arrival_s", 0.0)  # the front end's part before the engine's queue
    records: dict[str, RequestRecord] = {}
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    steps: list = []  # (start time, tiebreak, replica): each stepping replica's next step
    order = itertools.count()
    num_steps = num_bulk = 0
    last_end = 0.0
    next_arrival = 0
    inf = float("inf")
    route = _RouteIndex.make(policy, replicas)
    while next_arrival < len(arrivals) or steps:
        t_arrive = (arrivals[next_arrival].arrival_s + lag if next_arrival < len(arrivals)
                    else inf)
        if t_arrive <= (steps[0][0] if steps else inf):  # same instant: arrival first
            _arrive(f"r{next_arrival}", arrivals[next_arrival], replicas, policy, records,
                    steps, order, lag, route)
            next_arrival += 1
            continue
        t, _, rep = heapq.heappop(steps)
        rep.clock.now = t
        n = advance_decodes(rep, t_arrive, records, defer=True) if bulk else 0
        rep.changed()
        if n:
            num_steps += n
            num_bulk += n
        else:  # (a bulk advance never preempts: it stops short of it)
            _step(rep, records, bulk)
            if stop_on_preempt and rep.engine.scheduler.num_preemptions:
                raise _CacheNeeded
            num_steps += 1
            if rep.last_finish is not None:
                last_end = max(last_end, rep.last_finish)
        if rep.engine.has_unfinished:
            heapq.heappush(steps, (rep.clock.now, next(order), rep))
        else:
            rep.is_stepping = False
    for rep in replicas:  # none is left pending (each ran to its last step), but be sure
        finish_run(rep, records)
    first = min((r.arrival_s for r in requests), default=0.0)
    return SimResult(list(records.values()), replicas, max(last_end - first, 1e-9),
                     time.perf_counter() - started, num_steps, num_bulk,
                     sum(r.num_mixed_steps for r in replicas))


class _RouteIndex:
    """A policy's incremental picker (`load_index`, LeastLoaded's) fed with the loads of
    the replicas that changed since the last arrival, instead of every replica's load at
    every arrival: the same pick (tests/sim/test_bulk.py), O(changed x log n) an arrival."""

    def __init__(self, index, replicas: list[Replica]):
        self.index = index
        self.replicas = replicas
        self.dirty: set[int] = set()
        for rep in replicas:
            rep._dirty = self.dirty

    @classmethod
    def make(cls, policy: RoutingPolicy, replicas: list[Replica]) -> "_RouteIndex | None":
        make_index = getattr(policy, "load_index", None)
        if make_index is None or getattr(policy, "reads_cached_tokens", True):
            return None
        return cls(make_index([rep.load() for rep in replicas]), replicas)

    def pick(self) -> int:
        index, replicas = self.index, self.replicas
        for i in self.dirty:
            index.update(i, replicas[i].load())
        self.dirty.clear()
        return index.pick()


def _arrive(rid: str, req: SimRequest, replicas: list[Replica], policy: RoutingPolicy,
            records: dict[str, RequestRecord], steps: list, order, lag: float = 0.0,
            index: _RouteIndex | None = None) -> None:
    """The request reaches the engine's queue `lag` after it was sent (the record's
    times are the client's). index: the policy's incremental picker over `replicas`."""
    sent = req.arrival_s
    t = sent + lag
    if index is not None:
        rep = replicas[index.pick()]
    else:
        route = RouteRequest(len(req.prompt_token_ids) + req.max_tokens)
        # The prefix caches are only looked up for a policy that reads the cached tokens.
        prompt = req.prompt_token_ids if getattr(policy, "reads_cached_tokens", True) else None
        rep = replicas[policy.pick([x.load(prompt) for x in replicas], route)]
    records[rid] = rec = RequestRecord(len(req.prompt_token_ids), req.max_tokens,
                                       scheduled_time=sent, sent_time=sent, written_time=sent)
    if rep.engine.scheduler.policy is not None:  # its admission check reads the running
        finish_run(rep, records)  # sequences' lengths: as stepping would have left them
    if not rep.is_stepping:  # the SLO policy's admission check reads the replica's clock
        rep.clock.now = max(rep.clock.now, t)
    try:
        rep.engine.add_request(EngineRequest(
            rid, req.prompt_token_ids,
            SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True),
            arrival_time=sent, slo=req.slo))  # the front end stamps it
    except SLOUnattainableError as exc:  # the SLO policy's early 429: the client sees it now
        rec.error, rec.error_detail, rec.end_time = "slo_unattainable", str(exc), t
        return
    rep.changed()
    if not rep.is_stepping:  # its clock was brought up to the arrival above
        rep.is_stepping = True
        heapq.heappush(steps, (rep.clock.now, next(order), rep))


def _step(rep: Replica, records: dict[str, RequestRecord], hide: bool = False) -> list[str]:
    """One Engine.step; its tokens stamped at the step's end. hide: its leading plain
    decodes may be run outside the engine (bulk.mixed_step: the same result, faster).
    Returns the requests it finished."""
    if hide:
        deltas = mixed_step(rep, records)
    else:
        finish_run(rep, records)  # the engine's step reads every running sequence
        deltas = None
    if deltas is None:
        deltas = rep.engine.step()  # advances rep.clock by the step's cost
    else:
        rep.num_mixed_steps += 1
    now = rep.clock.now
    rep.last_finish = None
    finished = []
    for d in deltas:
        rec = records[d.request_id]
        if d.token_ids:
            if rec.first_token_time is None:
                rec.first_token_time = now
            rec.chunk_times.append(now)
            rec.num_output_tokens += len(d.token_ids)
        if d.timings is not None:
            rec.end_time = now
            rec.has_usage = True
            rec.usage_prompt_tokens = d.num_prompt_tokens
            rep.last_finish = now
            finished.append(d.request_id)
    bm, sched = rep.engine.block_manager, rep.engine.scheduler
    rep.timeline.append((now, bm.num_used_blocks / bm.num_blocks, len(sched.waiting),
                         len(sched.running)))
    return finished


__all__ = ["Replica", "ReplicaSpec", "SimRequest", "SimResult", "simulate"]
