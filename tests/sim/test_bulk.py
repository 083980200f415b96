"""Bulk advance of plain decode steps gives exactly what stepping gives: the same workloads
run both ways have identical per-request timings and token counts, the same steps, clocks,
engine counters, preemptions and prefix-cache state, on fixed workloads that exercise
preemption, prefix sharing, a full running list and the context limit, and on random small
ones (hypothesis)."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.bench.workloads import conversation
from servelm.router.policies import make_policy, policy_names
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import ReplicaSpec, SimRequest, SimResult, simulate

COST = StepCostModel("ctx", base_s=0.003, per_seq_s=0.0001, per_decode_token_s=0.0004,
                     per_decode_context_s=3e-7, per_prefill_token_s=0.00004,
                     per_prefill_pair_s=1e-9)


def _record_key(r) -> tuple:
    return (r.sent_time, r.first_token_time, r.end_time, tuple(r.chunk_times),
            r.num_output_tokens, r.usage_prompt_tokens, r.num_prompt_tokens, r.is_ok)


def _replica_state(rep) -> dict:
    cache = rep.engine.block_manager.prefix_cache
    return {"clock": rep.clock.now, "steps": rep.runner.num_steps, "busy": rep.runner.busy_s,
            "preemptions": rep.engine.scheduler.num_preemptions,
            "stats": dataclasses.asdict(rep.engine.stats), "timeline": rep.timeline,
            "free": rep.engine.block_manager.num_free_blocks,
            "cache": None if cache is None else (
                dataclasses.asdict(cache.stats), cache.num_cached_blocks,
                cache.num_evictable_blocks,
                # when each cached block was last touched: the LRU order eviction follows
                sorted((b, node.last_access) for b, node in cache._nodes.items()))}


def run_both(requests, num_replicas, spec, policy, cost=COST,
             skip_idle_cache: bool = False) -> tuple[SimResult, SimResult]:
    """Stepped and bulk runs, compared. The prefix caches are kept by default (the bulk
    path's block filing is what is compared); tests/sim/test_speed.py covers the runs
    that leave them out."""
    stepped = simulate(requests, num_replicas, spec, cost, make_policy(policy), bulk=False,
                       skip_idle_cache=skip_idle_cache)
    bulk = simulate(requests, num_replicas, spec, cost, make_policy(policy), bulk=True,
                    skip_idle_cache=skip_idle_cache)
    assert stepped.num_bulk_steps == stepped.num_mixed_steps == 0
    assert sorted(map(_record_key, bulk.records)) == sorted(map(_record_key, stepped.records))
    assert bulk.num_steps == stepped.num_steps
    assert bulk.elapsed_s == stepped.elapsed_s
    for a, b in zip(bulk.replicas, stepped.replicas):
        assert _replica_state(a) == _replica_state(b)
        a.engine.check_invariants()
    return stepped, bulk


def _random_requests(n, seed, prompt=(10, 600), output=(1, 64), span=5.0):
    rng = random.Random(seed)
    return [SimRequest(rng.uniform(0, span), [rng.randrange(100, 900)
                                              for _ in range(rng.randint(*prompt))],
                       rng.randint(*output)) for _ in range(n)]


def test_under_preemption_bulk_is_stepping():
    spec = ReplicaSpec(num_blocks=96, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    stepped, bulk = run_both(_random_requests(200, 0), 3, spec, "least_loaded")
    assert sum(r.engine.scheduler.num_preemptions for r in bulk.replicas) > 0
    assert bulk.num_bulk_steps > 0.2 * bulk.num_steps  # the comparison covers bulk steps


def test_least_busy_routes_alike_stepped_and_bulk():
    """least_busy reads the replicas' request counts, which the bulk path's lazy decode
    head must keep exact at every arrival."""
    spec = ReplicaSpec(num_blocks=512, block_size=16, max_num_seqs=8,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    stepped, bulk = run_both(_random_requests(150, 3, output=(1, 200)), 3, spec, "least_busy")
    assert bulk.num_bulk_steps > 0
    routed = [rep.num_routed for rep in bulk.replicas]
    assert sum(routed) == 150 and min(routed) > 0
    # and most of the other steps ran their leading decodes hidden (bulk.mixed_step)
    assert bulk.num_mixed_steps > 0.5 * (bulk.num_steps - bulk.num_bulk_steps)


def test_long_decodes_with_a_full_running_list_are_mostly_bulk():
    """Few arrivals and long outputs: nearly every step is plain, including those where
    requests wait because max_num_seqs sequences run."""
    spec = ReplicaSpec(num_blocks=2048, block_size=16, max_num_seqs=8,
                       max_num_batched_tokens=512, max_model_len=4096, vocab_size=1000)
    reqs = _random_requests(30, 1, prompt=(20, 200), output=(100, 400), span=1.0)
    stepped, bulk = run_both(reqs, 2, spec, "round_robin")
    assert max(w for rep in bulk.replicas for _, _, w, _ in rep.timeline) > 0  # queued
    assert bulk.num_bulk_steps > 0.8 * bulk.num_steps


def test_equal_outputs_finishing_at_the_head_of_the_running_list():
    """Equal output lengths (a fixed-shape workload): the oldest sequence finishes first, at
    the head of the running list, while younger ones prefill behind it; the steps around
    each finish still hide the other decodes, and give what stepping gives."""
    spec = ReplicaSpec(num_blocks=600, block_size=16, max_num_seqs=24,
                       max_num_batched_tokens=160, max_model_len=1024, vocab_size=1000)
    reqs = [SimRequest(0.02 * i, [100 + i % 7] * 5 + [300 + i] * 300, 60) for i in range(80)]
    stepped, bulk = run_both(reqs, 2, spec, "least_loaded")
    engine_steps = bulk.num_steps - bulk.num_bulk_steps
    assert bulk.num_mixed_steps > 0.9 * engine_steps


def test_shared_prefixes_and_prefix_affinity_routing():
    spec = ReplicaSpec(num_blocks=400, block_size=16, max_num_seqs=32,
                       max_num_batched_tokens=512, max_model_len=4096, vocab_size=2000)
    work = conversation(120, (16, 400), (8, 120), 2000, seed=3)
    rng = random.Random(3)
    t = 0.0
    reqs = []
    for r in work:
        t += rng.expovariate(30.0)
        reqs.append(SimRequest(t, r.prompt_token_ids, r.max_tokens))
    stepped, bulk = run_both(reqs, 3, spec, "prefix_affinity")
    hits = sum(rep.engine.block_manager.prefix_cache.stats.num_hit_tokens
               for rep in bulk.replicas)
    assert hits > 0 and bulk.num_bulk_steps > 0


def test_the_context_limit_ends_a_bulk_run_where_stepping_ends_it():
    """max_model_len is the finish for these (prompt + max_tokens would pass it, so the
    engine caps max_tokens): the run must stop one step short of it."""
    spec = ReplicaSpec(num_blocks=256, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=100, vocab_size=1000)
    reqs = [SimRequest(0.01 * i, [200 + i] * (30 + i), 70 - i) for i in range(8)]
    stepped, bulk = run_both(reqs, 1, spec, "round_robin")
    assert all(r.num_output_tokens == r.max_tokens for r in bulk.records)
    assert bulk.num_bulk_steps > 0


def test_an_arrival_at_a_step_start_is_admitted_before_that_step():
    """Steps of exactly 1/16 s and arrivals on multiples of 1/16 s: each arrival lands on
    a step boundary of a replica that is decoding, and must join the step that starts then."""
    spec = ReplicaSpec(num_blocks=512, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=512, max_model_len=1024, vocab_size=1000)
    reqs = [SimRequest(0.0, [300] * 40, 200)] + [
        SimRequest(k / 16, [400 + k] * 20, 30) for k in range(3, 60, 7)]
    for policy in ("round_robin", "least_loaded"):
        stepped, bulk = run_both(reqs, 2, spec, policy, StepCostModel("exact", base_s=1 / 16))
        assert bulk.num_bulk_steps > 0
        late = [r for r in stepped.records if r.sent_time > 0]
        assert all(r.ttft_s == 1 / 16 for r in late)  # prefilled by the step starting then


@st.composite
def _workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_len = draw(st.integers(20, 160))
    n = draw(st.integers(1, 24))
    vocab = draw(st.sampled_from([110, 130, 1000]))  # a small vocab makes shared prefixes
    reqs = []
    for _ in range(n):
        plen = draw(st.integers(1, max_len - 1))
        prompt = draw(st.lists(st.integers(100, vocab - 1), min_size=plen, max_size=plen))
        out = draw(st.integers(1, max_len - plen))
        # On a 1/64 s grid, with binary-exact step costs below: some arrivals fall exactly
        # on a step's start (the tie the fleet breaks in favour of the arrival).
        reqs.append(SimRequest(draw(st.integers(0, 128)) / 64, prompt, out))
    min_blocks = -(-max_len // block_size)
    spec = ReplicaSpec(num_blocks=draw(st.integers(min_blocks, 4 * min_blocks)),
                       block_size=block_size, max_num_seqs=draw(st.integers(1, 8)),
                       max_num_batched_tokens=draw(st.integers(4, 96)),
                       enable_prefix_caching=draw(st.booleans()), max_model_len=max_len,
                       vocab_size=vocab)
    cost = StepCostModel("h", base_s=draw(st.sampled_from([1 / 64, 1 / 16, 0.01])),
                         per_decode_token_s=draw(st.sampled_from([0.0, 1 / 1024])),
                         per_decode_context_s=draw(st.sampled_from([0.0, 1e-5])),
                         per_prefill_token_s=draw(st.sampled_from([0.0, 1 / 4096])))
    return reqs, draw(st.integers(1, 3)), spec, draw(st.sampled_from(policy_names())), cost


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_workloads())
def test_random_small_workloads_bulk_is_stepping(work):
    reqs, num_replicas, spec, policy, cost = work
    run_both(reqs, num_replicas, spec, policy, cost)


def test_a_run_of_synthetic_tokens_is_what_one_token_steps_append():
    """SimRunner.tokens (one slice, what bulk steps take) equals _token called once per
    step, across the table's wrap; no EOS among them."""
    from types import SimpleNamespace

    from servelm.sim.runner import _PERIOD, SimRunner, VirtualClock

    runner = SimRunner(COST, VirtualClock(), 130, (0, 7))
    for prompt in ([5] * 3, list(range(100, 129)), [129] * 40):
        stepped = SimpleNamespace(token_ids=list(prompt), num_prompt_tokens=len(prompt))
        for _ in range(_PERIOD + 50):
            stepped.token_ids.append(runner._token(stepped))
        run = SimpleNamespace(token_ids=list(prompt), num_prompt_tokens=len(prompt))
        run.token_ids += runner.tokens(run, 10)
        run.token_ids += runner.tokens(run, _PERIOD + 40)
        assert run.token_ids == stepped.token_ids
        assert not {0, 7} & set(run.token_ids[len(prompt):])


def test_a_run_leaves_no_cyclic_garbage_and_restores_the_collector():
    """simulate() turns Python's cyclic collector off while it runs (its passes over the
    fleet's live objects found nothing): a run, evicting from a small prefix cache and
    preempting, must leave nothing for the collector while its result is alive, and the
    collector on again after."""
    import gc

    spec = ReplicaSpec(num_blocks=96, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    gc.collect()
    assert gc.isenabled()
    sim = simulate(_random_requests(120, 7), 2, spec, COST, make_policy("least_loaded"))
    assert gc.isenabled()
    assert sum(r.engine.scheduler.num_preemptions for r in sim.replicas) > 0
    assert sum(r.engine.block_manager.prefix_cache.stats.num_evicted_blocks
               for r in sim.replicas) > 0
    assert gc.collect() == 0
    assert len(sim.records) == 120


def test_the_incremental_least_loaded_index_picks_what_least_loaded_picks():
    """LeastLoadedIndex (what the simulator routes with) after random single-replica
    updates, ties and unhealthy replicas included, equals LeastLoaded.pick over the list."""
    import pytest

    from servelm.router.policies import LeastLoaded, ReplicaLoad

    rng = random.Random(11)
    policy = LeastLoaded()
    for n in (1, 2, 5, 8, 33):
        def load():
            return ReplicaLoad(rng.randrange(3), rng.randrange(3), rng.choice([0, 5, 9, 40]),
                               rng.choice([0.0, 0.25, 0.5]), rng.random() < 0.85)
        loads = [load() for _ in range(n)]
        index = policy.load_index(loads)
        for _ in range(400):
            i = rng.randrange(n)
            loads[i] = load()
            index.update(i, loads[i])
            if any(x.is_healthy for x in loads):
                assert index.pick() == policy.pick(loads, None)
            else:
                with pytest.raises(RuntimeError):
                    index.pick()


def test_routing_with_the_incremental_index_is_routing_over_every_load():
    """least_loaded through its index (the fleet's default path) and through pick() over
    every replica's load at every arrival give the same run."""

    class OverTheList:  # least_loaded without load_index
        name = "least_loaded"
        reads_cached_tokens = False

        def __init__(self):
            self.inner = make_policy("least_loaded")

        def pick(self, loads, request):
            return self.inner.pick(loads, request)

    spec = ReplicaSpec(num_blocks=300, block_size=16, max_num_seqs=12,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    reqs = _random_requests(250, 12, span=3.0)
    a = simulate(reqs, 6, spec, COST, make_policy("least_loaded"))
    b = simulate(reqs, 6, spec, COST, OverTheList())
    assert list(map(_record_key, a.records)) == list(map(_record_key, b.records))
    for x, y in zip(a.replicas, b.replicas):
        assert _replica_state(x) == _replica_state(y)
    assert len({rep.engine.stats.num_steps for rep in a.replicas}) > 1


def test_the_heads_step_times_reset_and_trimmed_give_the_same_run(monkeypatch):
    """A head keeps its steps' end times for its members' records; it drops them when it
    empties and trims those no member needs on a long run: with the trim threshold tiny,
    so that both happen often, bulk advance still equals stepping."""
    from servelm.sim import bulk

    monkeypatch.setattr(bulk, "_TIMES_TRIM", 16)
    resets, trims = [], []
    step_done, sync = bulk.DecodeHead.step_done, bulk._sync

    def spy_step_done(self, now):
        t0 = self.t0
        step_done(self, now)
        if self.t0 != t0:
            trims.append(self.t0 - t0)

    def spy_sync(rep, records):
        head = rep.decode_head
        had = len(head.times) if head is not None else 0
        head = sync(rep, records)
        if had and not head.times:
            resets.append(had)
        return head

    monkeypatch.setattr(bulk.DecodeHead, "step_done", spy_step_done)
    monkeypatch.setattr(bulk, "_sync", spy_sync)
    spec = ReplicaSpec(num_blocks=2048, block_size=4, max_num_seqs=8,
                       max_num_batched_tokens=128, max_model_len=1024, vocab_size=1000)
    reqs = _random_requests(40, 13, prompt=(5, 60), output=(20, 300), span=4.0)
    run_both(reqs, 2, spec, "round_robin")
    assert resets and trims
