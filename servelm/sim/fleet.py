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
A fleet whose prompts can never hit a prefix cache runs without them until a preemption
or an arrival that could hit one, when it is run again with them (simulate, _FirstBlocks:
the same result, faster).

Scale: the requests may come as a stream (a re-iterable in arrival order, as the CLI's
random workload does), so that a run of millions holds only the prompts in flight; with
keep_chunk_times=False a finished request's chunk times go into an ITLSummary and its
record keeps its scalar times only.
"""

from __future__ import annotations

import copy
import gc
import heapq
import itertools
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Callable, Iterable, Sequence

from servelm.bench.metrics import RequestRecord
from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.engine.slo_policy import SLOUnattainableError
from servelm.protocol import EngineRequest, RequestSLO, SamplingParams
from servelm.router.policies import ReplicaLoad, RouteRequest, RoutingPolicy
from servelm.sim.bulk import DecodeHead, advance_decodes, finish_run, mixed_step
from servelm.engine.step_cost_model import StepCostModel, StepShape
from servelm.sim.itl import ITLSummary
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
    # whether its prompt's ids are known to be ints inside the vocabulary (a workload the
    # simulator drew itself): the engine then skips its per-token check (Engine.add_request)
    ids_checked: bool = False


@dataclass
class Replica:
    index: int
    engine: Engine
    clock: VirtualClock
    runner: SimRunner
    is_stepping: bool = False
    last_finish: float | None = None  # when the last step finished a request, if it did
    num_mixed_steps: int = 0  # engine steps run with the decode head lazy (bulk.mixed_step)
    num_routed: int = 0  # requests the router sent here (least_busy's tie-break)
    # The lazily advanced head of the running list (bulk.DecodeHead): its sequences and
    # records are caught up as they leave it, or all at once by bulk.finish_run.
    decode_head: DecodeHead | None = None
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)
    # (time, kv usage, waiting, running) after each step
    # where its requests' chunk gaps go when the records keep no chunk times, else None
    itl: ITLSummary | None = None
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
            num_requests = len(sched.waiting) + len(sched.running)
            base = self._load = ReplicaLoad(len(sched.waiting), len(sched.running), in_flight,
                                            bm.num_used_blocks / bm.num_blocks, True, 0,
                                            num_requests, self.num_routed)
        if prompt is None or bm.prefix_cache is None:
            return base
        cached = bm.prefix_cache.match(prompt, None, len(prompt) - 1, record=False).num_tokens
        return base._replace(cached_tokens=cached) if cached else base


@dataclass
class ReplicaReport:
    """What a run's result says of one replica (`servelm sim`'s per-replica block and
    timeline plot), as plain values: the result's reader needs no live engine."""

    index: int
    num_requests: int  # finished
    num_steps: int
    busy_s: float
    num_preemptions: int
    timeline: list[tuple[float, float, int, int]]  # (time, kv usage, waiting, running)
    # after each step
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    @classmethod
    def of(cls, rep: Replica) -> "ReplicaReport":
        engine = rep.engine
        cache = engine.block_manager.prefix_cache
        return cls(rep.index, sum(engine.stats.finished.values()), rep.runner.num_steps,
                   rep.runner.busy_s, engine.scheduler.num_preemptions, rep.timeline,
                   cache.stats.num_hit_tokens if cache is not None else 0,
                   cache.stats.num_query_tokens if cache is not None else 0)


@dataclass
class SimResult:
    records: list[RequestRecord]
    replicas: list[Replica]
    elapsed_s: float  # virtual: first arrival -> last finish
    wall_s: float
    num_steps: int
    num_bulk_steps: int = 0  # of num_steps, those advanced in bulk (plain decodes)
    num_mixed_steps: int = 0  # of num_steps, engine steps whose leading decodes were hidden
    # the gaps between chunks when the records dropped their chunk times
    # (simulate(keep_chunk_times=False)), else None: the records have them
    itl: ITLSummary | None = None
    # a sharded run's (servelm/sim/shards.py): its replicas' reports (it has no live
    # replicas), how many processes ran it, and each one's peak memory
    reports: list[ReplicaReport] | None = None
    num_shards: int = 1
    shard_max_rss_mb: list[float] = field(default_factory=list)

    @cached_property
    def replica_reports(self) -> list[ReplicaReport]:
        if self.reports is not None:
            return self.reports
        return [ReplicaReport.of(rep) for rep in self.replicas]

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


def simulate(requests: Iterable[SimRequest], num_replicas: int, spec: ReplicaSpec,
             cost: StepCostModel, policy: RoutingPolicy, bulk: bool = True,
             skip_idle_cache: bool = True, keep_chunk_times: bool = True,
             shards: int = 1) -> SimResult:
    """Run every request to completion; returns what a client would have measured.
    requests: a sequence (any order), or a re-iterable stream in arrival order (iterated
    again if the run restarts with prefix caches; an arrival out of order is an error).
    bulk: run plain decode steps in bulk (the same result, faster).
    skip_idle_cache: leave the replicas' prefix caches out while no admission could hit
    them (the same result, faster; see _FirstBlocks).
    keep_chunk_times: the records keep their chunk times; else each finished request's
    go into SimResult.itl and its record drops them (the memory of a run of millions).
    shards: run the replicas in this many forked processes, routed as one fleet (the same
    result, in less wall time on as many cores; servelm/sim/shards.py), where the policy
    allows it (shards.can_shard: least_loaded), else in this one. The result then has no
    live replicas, only their reports.

    Python's cyclic garbage collector is off while it runs (and restored after): the
    simulation builds millions of long-lived objects (prefix-cache nodes, records) and
    frees what it drops by reference counting alone, so the collector's passes over the
    live objects found nothing and were a large share of the time (tests/sim/test_bulk.py
    checks that a run leaves no cyclic garbage behind while its result is alive)."""
    started = time.perf_counter()
    run = _simulate
    if shards > 1 and num_replicas > 1:
        from servelm.sim import shards as sharding

        if sharding.can_shard(policy):
            run = partial(sharding.run_shards, num_shards=shards)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        firsts = _FirstBlocks(spec.block_size)
        if isinstance(requests, Sequence):  # all at hand: checked before, not during, the run
            requests = sorted(requests, key=lambda r: r.arrival_s)
            if not all(firsts.admits(r.prompt_token_ids) for r in requests):
                skip_idle_cache = False
            firsts.seen = None
        if skip_idle_cache and spec.enable_prefix_caching:
            try:  # a copy of the policy: a restart must find it as it was (RoundRobin's turn)
                return run(requests, num_replicas,
                           replace(spec, enable_prefix_caching=False), cost,
                           copy.deepcopy(policy), bulk, started, keep_chunk_times,
                           firsts=firsts)
            except _CacheNeeded:
                pass  # an admission could hit a cache (or a preempted sequence its own
                # cached blocks): run with them
        return run(requests, num_replicas, spec, cost, policy, bulk, started,
                   keep_chunk_times, firsts=None)
    finally:
        if was_enabled:
            gc.enable()


class _CacheNeeded(Exception):
    """A run without prefix caches reached its first preemption, or an arrival whose
    admission could hit a cache (simulate restarts it with them)."""


class _FirstBlocks:
    """Whether, short of preemption, no admission can hit a replica's prefix cache: every
    prompt fills its first block, and no two prompts' first blocks are equal (checked
    arrival by arrival: `admits` is False at the first prompt that breaks it).

    A match starts at a prompt's first block, so it can then only find the sequence's own
    blocks, which are cached only after its admission: the one way back to them is a
    preempted sequence's re-admission. Until a preemption, then, every match finds
    nothing, and a cache changes no count the scheduler reads (its cached-only blocks count
    as free, the free list is taken before them), nor the routing (its cached tokens are
    0), the KV usage or the hit rate (0): a run without it takes the same steps (the
    sequences are n = 1 and unsalted, one namespace). It only saves filing ~144 cache
    nodes per 2,000-token request. tests/sim/test_speed.py checks the equality, and that
    a run with a preemption, or with a repeated first block, is restarted with the caches."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seen: set[int] | None = set()  # None: every arrival is known to be admitted

    def admits(self, ids: list[int]) -> bool:
        if self.seen is None:
            return True
        bs = self.block_size
        if len(ids) < bs:  # its first block would hold generated tokens too
            return False
        first = hash(tuple(ids[:bs]))  # equal hashes of unequal blocks: no harm, the
        if first in self.seen:  # cache is kept
            return False
        self.seen.add(first)
        return True


def _simulate(requests: Iterable[SimRequest], num_replicas: int, spec: ReplicaSpec,
              cost: StepCostModel, policy: RoutingPolicy, bulk: bool, started: float,
              keep_chunk_times: bool = True, firsts: _FirstBlocks | None = None) -> SimResult:
    """requests: in arrival order. firsts: raise _CacheNeeded at the first preemption or
    the first arrival it does not admit (simulate's first try without prefix caches)."""
    replicas = [_make_replica(i, spec, cost) for i in range(num_replicas)]
    lag = getattr(cost, "arrival_s", 0.0)  # the front end's part before the engine's queue
    records: dict[str, RequestRecord] = {}
    itl = None if keep_chunk_times else ITLSummary()
    for rep in replicas:
        rep.itl = itl
    route = _RouteIndex.make(policy, replicas)

    def arrive(j: int, req: SimRequest, steps: list, order) -> None:
        _arrive(f"r{j}", req, replicas, policy, records, steps, order, lag, route)

    first, last_end, num_steps, num_bulk = _event_loop(requests, arrive, lag, records, bulk,
                                                       itl, firsts)
    for rep in replicas:  # none is left pending (each ran to its last step), but be sure
        finish_run(rep, records)
    return SimResult(list(records.values()), replicas, max(last_end - first, 1e-9),
                     time.perf_counter() - started, num_steps, num_bulk,
                     sum(r.num_mixed_steps for r in replicas), itl)


PROGRESS_EVERY_S = 10.0  # wall seconds between a long run's progress lines (stderr)


def _report_progress(num_arrived: int, sent: float, first: float, started: float) -> None:
    wall = time.perf_counter() - started
    print(f"[sim] {num_arrived:,} requests arrived, {sent - first:,.1f} simulated s, "
          f"{wall:,.0f} s wall ({num_arrived / wall:,.0f} arrivals / wall s)",
          file=sys.stderr, flush=True)


def _event_loop(requests: Iterable[SimRequest], arrive, lag: float,
                records: dict[str, RequestRecord], bulk: bool, itl: ITLSummary | None,
                firsts: _FirstBlocks | None, report: bool = True, post=None
                ) -> tuple[float, float, int, int]:
    """Arrivals and steps in time order until every request is done: arrive(j, request,
    steps, order) routes and admits arrival j (its replica joins `steps`, the heap of each
    stepping replica's next step). Returns (the first arrival's send time, the last
    finish, steps run, of them in bulk). report: a progress line on stderr every
    PROGRESS_EVERY_S of wall time (checked every 4,096 arrivals).

    post (a shard's loop, shards.py): post(j, request) is called before arrive(j, ...)
    and returns the one replica that arrival j could go to here; the steps of every other
    replica that start before arrival j + 1 (the ones the loop would run next anyway, with
    the same bound) run between the two calls, since where j goes cannot change them."""
    arrivals = iter(requests)
    nxt = next(arrivals, None)
    first = nxt.arrival_s if nxt is not None else 0.0
    steps: list = []  # (start time, tiebreak, replica): each stepping replica's next step
    order = itertools.count()
    num_steps = num_bulk = num_arrived = 0
    last_end = 0.0
    inf = float("inf")
    started = last_report = time.perf_counter()
    while nxt is not None or steps:
        t_arrive = nxt.arrival_s + lag if nxt is not None else inf
        if t_arrive <= (steps[0][0] if steps else inf):  # same instant: arrival first
            if firsts is not None and not firsts.admits(nxt.prompt_token_ids):
                raise _CacheNeeded
            req, sent, nxt = nxt, nxt.arrival_s, next(arrivals, None)
            if nxt is not None and nxt.arrival_s < sent:
                raise ValueError(f"request {num_arrived + 1} is sent at {nxt.arrival_s} s, "
                                 f"before the one ahead of it ({sent} s): a stream of "
                                 "requests must be in arrival order")
            if post is not None:
                only = post(num_arrived, req)
                horizon = nxt.arrival_s + lag if nxt is not None else inf
                held = None
                while steps and steps[0][0] < horizon:
                    if steps[0][2] is only:
                        held = heapq.heappop(steps)
                        continue
                    n, b, fin = _next_step(steps, order, horizon, records, bulk, itl,
                                           firsts is not None)
                    num_steps += n
                    num_bulk += b
                    if fin is not None:
                        last_end = max(last_end, fin)
                if held is not None:
                    heapq.heappush(steps, held)
            arrive(num_arrived, req, steps, order)
            num_arrived += 1
            if report and not num_arrived & 4095 and (
                    time.perf_counter() - last_report >= PROGRESS_EVERY_S):
                last_report = time.perf_counter()
                _report_progress(num_arrived, sent, first, started)
            continue
        n, b, fin = _next_step(steps, order, t_arrive, records, bulk, itl, firsts is not None)
        num_steps += n
        num_bulk += b
        if fin is not None:
            last_end = max(last_end, fin)
    return first, last_end, num_steps, num_bulk


def _next_step(steps: list, order, t_arrive: float, records: dict[str, RequestRecord],
               bulk: bool, itl: ITLSummary | None, no_preemption: bool
               ) -> tuple[int, int, float | None]:
    """Run the earliest stepping replica's next step (or its bulk run of plain decodes
    that start before t_arrive, the next arrival's time); returns (steps run, of them in
    bulk, when the step finished a request or None). no_preemption: raise _CacheNeeded
    at a preemption (a run without prefix caches)."""
    t, _, rep = heapq.heappop(steps)
    rep.clock.now = t
    n = advance_decodes(rep, t_arrive, records, defer=True) if bulk else 0
    rep.changed()
    fin = None
    if not n:  # (a bulk advance never preempts: it stops short of it)
        _step(rep, records, bulk, itl)
        if no_preemption and rep.engine.scheduler.num_preemptions:
            raise _CacheNeeded
        fin = rep.last_finish
    if rep.engine.has_unfinished:
        heapq.heappush(steps, (rep.clock.now, next(order), rep))
    else:
        rep.is_stepping = False
    return (n, n, None) if n else (1, 0, fin)


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
        self._catch_up()
        return self.index.pick()

    def least(self) -> tuple:
        """The index's winning key (LeastLoadedIndex.least), up to date."""
        self._catch_up()
        return self.index.least()

    def _catch_up(self) -> None:
        index, replicas = self.index, self.replicas
        for i in self.dirty:
            index.update(i, replicas[i].load())
        self.dirty.clear()


def _arrive(rid: str, req: SimRequest, replicas: list[Replica], policy: RoutingPolicy,
            records: dict[str, RequestRecord], steps: list, order, lag: float = 0.0,
            index: _RouteIndex | None = None) -> None:
    """The request reaches the engine's queue `lag` after it was sent (the record's
    times are the client's). index: the policy's incremental picker over `replicas`."""
    if index is not None:
        rep = replicas[index.pick()]
    else:
        route = RouteRequest(len(req.prompt_token_ids) + req.max_tokens)
        # The prefix caches are only looked up for a policy that reads the cached tokens.
        prompt = req.prompt_token_ids if getattr(policy, "reads_cached_tokens", True) else None
        rep = replicas[policy.pick([x.load(prompt) for x in replicas], route)]
    _admit(rid, req, rep, records, steps, order, lag)


def _admit(rid: str, req: SimRequest, rep: Replica, records: dict[str, RequestRecord],
           steps: list, order, lag: float = 0.0) -> None:
    """The routed request enters rep's engine (or is refused by its SLO policy)."""
    sent = req.arrival_s
    t = sent + lag
    records[rid] = rec = RequestRecord(len(req.prompt_token_ids), req.max_tokens,
                                       scheduled_time=sent, sent_time=sent, written_time=sent)
    if rep.engine.scheduler.policy is not None:  # its admission check reads the running
        finish_run(rep, records)  # sequences' lengths: as stepping would have left them
    if not rep.is_stepping:  # the SLO policy's admission check reads the replica's clock
        rep.clock.now = max(rep.clock.now, t)
    rep.num_routed += 1
    try:
        rep.engine.add_request(EngineRequest(
            rid, req.prompt_token_ids,
            SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True),
            arrival_time=sent, slo=req.slo),  # the front end stamps it
            prompt_checked=req.ids_checked)
    except SLOUnattainableError as exc:  # the SLO policy's early 429: the client sees it now
        rec.error, rec.error_detail, rec.end_time = "slo_unattainable", str(exc), t
        rep.changed()  # its routed count moved
        return
    rep.changed()
    if not rep.is_stepping:  # its clock was brought up to the arrival above
        rep.is_stepping = True
        heapq.heappush(steps, (rep.clock.now, next(order), rep))


def _step(rep: Replica, records: dict[str, RequestRecord], hide: bool = False,
          itl: ITLSummary | None = None) -> list[str]:
    """One Engine.step; its tokens stamped at the step's end. hide: its leading plain
    decodes may be run outside the engine (bulk.mixed_step: the same result, faster).
    itl: where the request's chunk gaps go (its record then keeps its last chunk time
    only, and none once it finishes).
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
            if itl is None:
                rec.chunk_times.append(now)
            else:  # the record keeps its last chunk time only
                chunks = rec.chunk_times
                if chunks:
                    itl.add_gap(now - chunks[0])
                    chunks[0] = now
                else:
                    chunks.append(now)
            rec.num_output_tokens += len(d.token_ids)
        if d.timings is not None:
            rec.end_time = now
            rec.has_usage = True
            rec.usage_prompt_tokens = d.num_prompt_tokens
            rep.last_finish = now
            finished.append(d.request_id)
            if itl is not None:
                rec.chunk_times = _NO_TIMES
    bm, sched = rep.engine.block_manager, rep.engine.scheduler
    rep.timeline.append((now, bm.num_used_blocks / bm.num_blocks, len(sched.waiting),
                         len(sched.running)))
    return finished


_NO_TIMES: list[float] = []  # a finished record's chunk times once folded away (shared; never
# appended to: a finished request takes no more tokens)

__all__ = ["Replica", "ReplicaReport", "ReplicaSpec", "SimRequest", "SimResult", "simulate"]
