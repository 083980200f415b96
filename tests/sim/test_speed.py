"""The simulator's shortcuts that are not bulk advance give exactly what the plain run
gives: a fleet whose prompts can never hit a prefix cache runs without caches
(fleet._FirstBlocks), and is restarted with them at its first preemption or at the first
arrival that could hit one; a stream of requests gives what the same list gives; the CLI's
random workload (prompts as windows of one pool) the timings of bench serve's prompts; and
the ITL summary of records that dropped their chunk times what the chunk times give."""

from __future__ import annotations

import random

import pytest

from servelm.router.policies import make_policy
from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate
from test_bulk import COST, _record_key, _replica_state, run_both


def _distinct_prompts(n, seed, prompt=(16, 600), output=(1, 64), span=5.0):
    """Random prompts of at least one block: first blocks distinct (with ids 100..999 and
    16 of them, equal ones do not happen)."""
    rng = random.Random(seed)
    return [SimRequest(rng.uniform(0, span), [rng.randrange(100, 1000)
                                              for _ in range(rng.randint(*prompt))],
                       rng.randint(*output)) for _ in range(n)]


def _state_but_cache(rep) -> dict:
    state = _replica_state(rep)
    state.pop("cache")
    return state


def _same_run(a, b) -> None:
    assert list(map(_record_key, a.records)) == list(map(_record_key, b.records))
    assert (a.num_steps, a.num_bulk_steps, a.num_mixed_steps, a.elapsed_s) == \
        (b.num_steps, b.num_bulk_steps, b.num_mixed_steps, b.elapsed_s)
    for x, y in zip(a.replicas, b.replicas):
        assert _state_but_cache(x) == _state_but_cache(y)


def test_a_fleet_that_cannot_hit_its_caches_runs_without_them_and_the_same():
    spec = ReplicaSpec(num_blocks=4000, block_size=16, max_num_seqs=24,
                       max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000)
    reqs = _distinct_prompts(300, 3)
    for policy in ("least_loaded", "round_robin", "prefix_affinity"):
        kept = simulate(reqs, 4, spec, COST, make_policy(policy), skip_idle_cache=False)
        fast = simulate(reqs, 4, spec, COST, make_policy(policy))
        assert all(r.engine.block_manager.prefix_cache is None for r in fast.replicas)
        assert all(r.engine.block_manager.prefix_cache is not None for r in kept.replicas)
        assert sum(r.engine.block_manager.prefix_cache.stats.num_hit_tokens
                   for r in kept.replicas) == 0
        _same_run(fast, kept)
    # without caches, bulk advance is still stepping (and the bulk steps are many)
    stepped, bulk = run_both(reqs, 4, spec, "least_loaded", skip_idle_cache=True)
    assert bulk.replicas[0].engine.block_manager.prefix_cache is None
    assert bulk.num_bulk_steps > 0.2 * bulk.num_steps


def test_a_preemption_restarts_the_run_with_its_caches():
    """A preempted sequence, admitted again, hits its own cached blocks: the run without
    caches would differ from there, so it is run again with them."""
    spec = ReplicaSpec(num_blocks=96, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    reqs = _distinct_prompts(200, 0, prompt=(16, 600))
    kept = simulate(reqs, 3, spec, COST, make_policy("round_robin"), skip_idle_cache=False)
    fast = simulate(reqs, 3, spec, COST, make_policy("round_robin"))
    assert sum(r.engine.scheduler.num_preemptions for r in kept.replicas) > 0
    assert sum(r.engine.block_manager.prefix_cache.stats.num_hit_tokens
               for r in kept.replicas) > 0  # the re-admissions' own blocks
    assert all(r.engine.block_manager.prefix_cache is not None for r in fast.replicas)
    _same_run(fast, kept)
    assert [_replica_state(x) for x in fast.replicas] == \
        [_replica_state(y) for y in kept.replicas]


def test_prompts_that_could_share_keep_their_caches():
    spec = ReplicaSpec(num_blocks=2000, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    shared = list(range(100, 116))  # one first block, then distinct tails
    reqs = [SimRequest(0.01 * i, shared + [200 + i] * 30, 8) for i in range(20)]
    short = [SimRequest(0.01 * i, [300 + i] * 15, 8) for i in range(20)]  # under a block
    for workload in (reqs, short):
        sim = simulate(workload, 2, spec, COST, make_policy("least_loaded"))
        assert all(r.engine.block_manager.prefix_cache is not None for r in sim.replicas)
    hits = sum(r.engine.block_manager.prefix_cache.stats.num_hit_tokens
               for r in simulate(reqs, 1, spec, COST, make_policy("least_loaded")).replicas)
    assert hits > 0


def test_the_sim_runner_samples_what_a_runner_state_would():
    """SimRunner keeps per sequence only its token count and offset; a RunnerState fed the
    same steps (prefill chunks, decodes, preemptions, finishes) samples the same sequences,
    and _token over its sequences gives the same ids."""
    from servelm.config import SchedulerConfig
    from servelm.core.runner_state import RunnerState
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine
    from servelm.protocol import EngineRequest, SamplingParams
    from servelm.sim.runner import SimRunner, VirtualClock

    class Checked(SimRunner):
        def __init__(self):
            super().__init__(COST, VirtualClock(), 1000, (0,))
            self.reference = RunnerState()
            self.num_sampled = self.num_chunks = 0

        def execute(self, step):
            scheduled = self.reference.apply(step)
            expected = [(s.seq.seq_id, self._token(s.seq)) for s in scheduled if s.is_sampling]
            self.num_chunks += len(scheduled) - len(expected)  # prompt chunks short of the end
            result = super().execute(step)
            assert [(t.seq_id, t.token_id) for t in result.sampled] == expected
            self.num_sampled += len(expected)
            return result

    runner = Checked()
    engine = Engine(runner, None, BlockManager(24, 16, False), SchedulerConfig(64, 8, True),
                    512, 1000, (0,), clock=runner.clock)
    rng = random.Random(5)
    for i in range(12):
        engine.add_request(EngineRequest(
            f"r{i}", [rng.randrange(100, 1000) for _ in range(rng.choice([20, 65, 90]))],
            SamplingParams(max_tokens=rng.randint(2, 60), temperature=0, ignore_eos=True)))
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert runner.num_sampled > 12 and runner.num_chunks > 0
    assert runner._seqs.keys() == runner.reference.seqs.keys()  # the last finish is unsent


def test_summarize_sorts_once_and_gives_the_percentiles_of_results():
    """bench.metrics.summarize (an ITL summary of a large run has a value per token) sorts
    once; its percentiles are results._percentile's, float for float."""
    from servelm.bench.metrics import PERCENTILES, summarize
    from servelm.bench.results import _percentile

    rng = random.Random(2)
    for n in (1, 2, 3, 10, 1001):
        values = [rng.choice([0.5, 1 / 3, rng.random()]) for _ in range(n)] + [None]
        got = summarize(values, 1e3)
        scaled = [v * 1e3 for v in values if v is not None]
        assert got["n"] == n and got["max"] == max(scaled)
        assert [got[f"p{q}"] for q in PERCENTILES] == [_percentile(scaled, q)
                                                       for q in PERCENTILES]
        assert list(got) == ["n", "mean", *(f"p{q}" for q in PERCENTILES), "max"]


class _Stream:
    """A re-iterable in arrival order, as the CLI's RequestStream."""

    def __init__(self, reqs):
        self.reqs = sorted(reqs, key=lambda r: r.arrival_s)
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(self.reqs)


def test_a_stream_of_requests_runs_as_the_list_and_restarts_at_a_repeated_first_block():
    spec = ReplicaSpec(num_blocks=4000, block_size=16, max_num_seqs=24,
                       max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000)
    reqs = _distinct_prompts(200, 5, prompt=(16, 600))
    as_list = simulate(reqs, 3, spec, COST, make_policy("least_loaded"))
    stream = _Stream(reqs)
    streamed = simulate(stream, 3, spec, COST, make_policy("least_loaded"))
    _same_run(streamed, as_list)
    # a late request repeats an early one's first block: the stream's run restarts with
    # caches at that arrival, and ends as the list's run (checked before it starts) does
    late = SimRequest(99.0, reqs[0].prompt_token_ids[:16] + [500] * 40, 8)
    stream = _Stream([*reqs, late])
    streamed = simulate(stream, 3, spec, COST, make_policy("least_loaded"))
    assert stream.passes == 2
    assert all(r.engine.block_manager.prefix_cache is not None for r in streamed.replicas)
    _same_run(streamed, simulate([*reqs, late], 3, spec, COST, make_policy("least_loaded")))
    with pytest.raises(ValueError, match="arrival order"):
        simulate(iter([reqs[1], SimRequest(reqs[1].arrival_s - 1, [101] * 20, 2)]), 1, spec,
                 COST, make_policy("round_robin"))


def test_the_cli_workload_gives_the_timings_of_bench_serves_prompts():
    """servelm sim's random workload (windows of one pool, drawn as the run goes, the
    per-token check skipped) against bench serve's random_lengths prompts at the same send
    times: the same records, steps and replica state, prefix caches on."""
    from servelm.bench.workloads import random_lengths
    from servelm.sim import cli as sim_cli

    args = sim_cli.add_parser(__import__("argparse").ArgumentParser().add_subparsers()) \
        .parse_args(["--cost-model", "x", "--request-rate", "300", "--num-prompts", "150",
                     "--input-len", "16:400", "--output-len", "2:60", "--vocab-size", "1000",
                     "--seed", "4"])
    spec = ReplicaSpec(num_blocks=200, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=384, max_model_len=2048, vocab_size=1000)
    stream = sim_cli.build_requests(args, 300.0, spec.vocab_size)
    assert isinstance(stream, sim_cli.RequestStream) and stream.ids_checked
    plain = [SimRequest(s.arrival_s, r.prompt_token_ids, r.max_tokens, s.slo)
             for s, r in zip(stream, random_lengths(150, "16:400", "2:60", 1000, 4))]
    for skip in (True, False):  # without, and (preempting) with, the caches
        a = simulate(stream, 3, spec, COST, make_policy("least_loaded"), skip_idle_cache=skip)
        b = simulate(plain, 3, spec, COST, make_policy("least_loaded"), skip_idle_cache=skip)
        assert list(map(_record_key, a.records)) == list(map(_record_key, b.records))
        assert (a.num_steps, a.elapsed_s) == (b.num_steps, b.elapsed_s)
    assert sum(r.engine.scheduler.num_preemptions for r in a.replicas) > 0
    too_wide = sim_cli.build_requests(args, 300.0, 900)  # the engine's vocabulary is smaller
    assert not too_wide.ids_checked


@pytest.mark.parametrize("trim", [None, 8])
def test_the_itl_summary_of_dropped_chunk_times_is_the_records_one(monkeypatch, trim):
    """The decode head's shared gaps (counted per member span, folded when its times are
    dropped: trim 8 drops them every few steps) and the engine steps' own, against every
    record's chunk times."""
    from servelm.bench.metrics import summarize
    from servelm.sim import bulk
    from servelm.sim.itl import ITLSummary

    if trim is not None:
        monkeypatch.setattr(bulk, "_TIMES_TRIM", trim)
    spec = ReplicaSpec(num_blocks=4000, block_size=16, max_num_seqs=24,
                       max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000)
    reqs = _distinct_prompts(200, 6, prompt=(16, 600), output=(1, 200))
    kept = simulate(reqs, 3, spec, COST, make_policy("least_loaded"))
    dropped = simulate(reqs, 3, spec, COST, make_policy("least_loaded"),
                       keep_chunk_times=False)
    gaps = [g for r in kept.records for g in r.itls_s]
    assert len(gaps) > 5000 and kept.itl is None and dropped.num_bulk_steps > 1000
    assert dropped.itl.summary_ms() == summarize(gaps, 1e3)
    assert all(not r.chunk_times for r in dropped.records)
    assert [(r.first_token_time, r.end_time, r.num_output_tokens) for r in dropped.records] \
        == [(r.first_token_time, r.end_time, r.num_output_tokens) for r in kept.records]
    # over its limit it bins: percentiles within the bins' 0.01%, mean and max as exact
    small = ITLSummary(exact_limit=500)
    for r in kept.records:
        small.add(r.chunk_times)
    binned, exact = small.summary_ms(), summarize(gaps, 1e3)
    assert binned["binned"] and binned["n"] == exact["n"]
    for q in ("p50", "p90", "p95", "p99"):
        assert binned[q] == pytest.approx(exact[q], rel=1e-4)
    assert binned["mean"] == pytest.approx(exact["mean"], rel=1e-12)
    assert binned["max"] == exact["max"]


def test_a_long_run_reports_its_progress_on_stderr(monkeypatch, capsys):
    """Every 4,096 arrivals, once PROGRESS_EVERY_S of wall time has passed (0 here): a
    line with the arrivals so far and the simulated time they span."""
    import servelm.sim.fleet as fleet
    monkeypatch.setattr(fleet, "PROGRESS_EVERY_S", 0.0)
    rng = random.Random(3)
    reqs = [SimRequest(i * 0.001, [rng.randrange(100, 1000) for _ in range(20)], 2)
            for i in range(8192)]
    simulate(reqs, 2, ReplicaSpec(num_blocks=4096, block_size=16), COST,
             make_policy("least_loaded"), shards=1)
    lines = [x for x in capsys.readouterr().err.splitlines() if "requests arrived" in x]
    assert [x.split(" requests")[0] for x in lines] == ["[sim] 4,096", "[sim] 8,192"]
    assert "4.1 simulated s" in lines[0] and "8.2 simulated s" in lines[1]
