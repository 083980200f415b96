"""The fleet simulator: the real engine in virtual time, exact where the arithmetic is
known, consistent with the scheduler's own rules, and its cost-model fit."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from servelm.router.policies import make_policy
from servelm.engine.step_cost_model import StepCostModel, StepShape, fit_cost_model
from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate

SPEC = ReplicaSpec(num_blocks=512, block_size=16, max_num_seqs=32,
                   max_num_batched_tokens=512, max_model_len=4096, vocab_size=1000)


def _const(step_s: float) -> StepCostModel:
    return StepCostModel("const", base_s=step_s)


def test_one_request_has_the_timings_the_arithmetic_gives():
    """Constant 10 ms steps: a 100-token prompt (one chunk) then 20 new tokens is a
    prefill step that yields the first token, then 19 decode steps."""
    sim = simulate([SimRequest(1.0, list(range(100, 200)), 20)], 1, SPEC, _const(0.01),
                   make_policy("round_robin"))
    (rec,) = sim.records
    assert rec.ttft_s == pytest.approx(0.01)
    assert rec.e2e_s == pytest.approx(0.20)
    assert rec.tpot_s == pytest.approx(0.01)
    assert rec.num_output_tokens == 20 and sim.num_steps == 20
    assert sim.elapsed_s == pytest.approx(0.20)


def test_chunked_prefill_and_a_queue_show_in_ttft():
    """A 1,200-token prompt takes three 512-token chunks; a second request arriving during
    the first chunk is admitted with the next step (after the first sequence's chunk, in
    the same step: the budget is shared) and so its first token comes no earlier than step 2."""
    reqs = [SimRequest(0.0, [7] * 1200, 4), SimRequest(0.005, [9] * 10, 4)]
    sim = simulate(reqs, 1, SPEC, _const(0.01), make_policy("round_robin"))
    a, b = sorted(sim.records, key=lambda r: r.sent_time)
    assert a.ttft_s == pytest.approx(0.03)  # chunks of 512 + 512 + 176
    assert b.first_token_time >= 0.02 - 1e-9  # waited for the step in flight
    assert b.ttft_s < a.ttft_s


def test_every_request_finishes_with_its_tokens_and_no_block_leaks():
    rng = random.Random(0)
    reqs = [SimRequest(rng.uniform(0, 5), [rng.randrange(100, 900) for _ in
                                           range(rng.randint(10, 600))], rng.randint(1, 64))
            for _ in range(200)]
    small = ReplicaSpec(num_blocks=96, block_size=16, max_num_seqs=16,
                        max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    cost = StepCostModel("lin", base_s=0.004, per_decode_token_s=0.0005,
                         per_prefill_token_s=0.00005)
    sim = simulate(reqs, 3, small, cost, make_policy("least_loaded"))
    assert len(sim.records) == 200 and all(r.is_ok for r in sim.records)
    assert sum(r.num_output_tokens for r in sim.records) == sum(r.max_tokens for r in reqs)
    for rep in sim.replicas:
        rep.engine.check_invariants()  # free + held + cached-only == total
        assert not rep.engine.scheduler.live_sequences()  # no sequence holds a block
    assert sum(rep.engine.scheduler.num_preemptions for rep in sim.replicas) > 0  # pressure


def test_more_replicas_cut_the_queue_and_least_loaded_beats_round_robin_on_skew():
    # Every 4th request is a long one: round robin sends them all to replica 0 of 4.
    reqs = [SimRequest(i * 0.02, [5 + i % 7] * (1500 if i % 4 == 0 else 50),
                       200 if i % 4 == 0 else 8) for i in range(160)]
    cost = StepCostModel("lin", base_s=0.005, per_decode_token_s=0.0004,
                         per_prefill_token_s=0.00004)
    p50, p95 = {}, {}
    for n, policy in ((1, "round_robin"), (4, "round_robin"), (4, "least_loaded")):
        sim = simulate(reqs, n, SPEC, cost, make_policy(policy))
        ttfts = sorted(r.ttft_s for r in sim.records)
        p50[(n, policy)], p95[(n, policy)] = ttfts[80], ttfts[152]
    # One replica is overloaded (TTFT p50 over 5 s); four are not, on the median.
    assert p50[(4, "round_robin")] < 0.1 < 5.0 < p50[(1, "round_robin")]
    # Round robin piles every long request onto replica 0, which queues (p95 ~8 s);
    # least_loaded spreads them (p95 under 0.2 s here).
    assert p95[(4, "least_loaded")] < 0.2 < 5.0 < p95[(4, "round_robin")]


def test_the_fit_recovers_known_coefficients_and_reports_its_error():
    rng = random.Random(1)
    truth = StepCostModel("truth", base_s=0.003, per_seq_s=0.0001, per_decode_token_s=0.0002,
                          per_decode_context_s=2e-7, per_prefill_token_s=0.00003,
                          per_prefill_pair_s=1e-9)
    shapes = [StepShape(rng.randint(1, 64), rng.randint(0, 64), rng.randint(0, 40000),
                        rng.randint(0, 2048), rng.randint(0, 2_000_000)) for _ in range(200)]
    seconds = [truth.predict(s) for s in shapes]
    fit = fit_cost_model("fit", shapes, seconds)
    for name in ("base_s", "per_seq_s", "per_decode_token_s", "per_decode_context_s",
                 "per_prefill_token_s", "per_prefill_pair_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)
    assert fit.fit["mean_abs_rel_error"] < 1e-9
    noisy = fit_cost_model("noisy", shapes, [s * rng.uniform(0.9, 1.1) for s in seconds])
    assert 0.01 < noisy.fit["mean_abs_rel_error"] < 0.1  # the noise shows in the report
    assert min(getattr(noisy, f) for f in ("base_s", "per_seq_s")) >= 0.0


def test_calibrate_fits_the_real_engine_and_sim_reads_the_model(tmp_path, tiny_hf,
                                                                tiny_engine):
    from servelm.bench.calibrate import calibrate

    engine = tiny_engine(tiny_hf("llama"), num_blocks=512, block_size=16,
                         max_num_batched_tokens=512)
    plan = [(1, 16, 8), (4, 64, 16), (16, 32, 16), (1, 400, 1), (3, 200, 1)]
    model = calibrate(engine, "tiny", plan, progress=False)
    assert model.fit["num_samples"] >= 40
    assert model.fit["engine"]["num_blocks"] == 512
    assert model.base_s + model.per_decode_token_s + model.per_prefill_token_s > 0
    path = tmp_path / "cost.json"
    model.save(path)
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--cost-model", str(path),
                           "--num-replicas", "2", "--policy", "least_loaded",
                           "--sweep-rates", "5,50", "--num-prompts", "40", "--input-len", "16:64",
                           "--output-len", "4:16", "--vocab-size", "384", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["kind"] == "serve_sweep" and [r["load"]["request_rate"] for r in doc["runs"]] \
        == [5.0, 50.0]
    assert all(r["num_completed"] == 40 for r in doc["runs"])
    # not lower at 10x the rate (equal, to the last bits, when both are unqueued)
    assert doc["runs"][1]["ttft_ms"]["p50"] >= doc["runs"][0]["ttft_ms"]["p50"] - 1e-9
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_load_a_policy_sees_is_the_replicas_state_at_that_arrival(monkeypatch):
    """Loads are kept between a replica's changes: at every routing decision they must equal
    what the replicas' queues and blocks say right then (stepping), and bulk advance, which
    leaves a paused run's sequences to be caught up later, must show the policy the same."""
    from servelm.sim import fleet

    replicas = []
    make = fleet._make_replica
    monkeypatch.setattr(fleet, "_make_replica",
                        lambda *a: replicas.append(make(*a)) or replicas[-1])

    class Checking:
        name = "checking"

        def __init__(self, check: bool):
            self.inner = make_policy("least_loaded")
            self.check = check
            self.seen = []

        def pick(self, loads, request):
            for load, rep in zip(loads, replicas if self.check else ()):
                sched, bm = rep.engine.scheduler, rep.engine.block_manager
                fresh = (len(sched.waiting), len(sched.running),
                         sum(s.num_uncomputed_tokens for s in sched.waiting)
                         + sum(s.max_tokens - s.num_output_tokens for s in sched.running),
                         bm.num_used_blocks / bm.num_blocks)
                assert load[:4] == fresh
            self.seen.append(list(loads))
            return self.inner.pick(loads, request)

    rng = random.Random(4)
    reqs = [SimRequest(rng.uniform(0, 3), [rng.randrange(100, 900) for _ in
                                           range(rng.randint(10, 300))], rng.randint(1, 40))
            for _ in range(150)]
    cost = StepCostModel("lin", base_s=0.004, per_decode_token_s=0.0005,
                         per_prefill_token_s=0.00005)
    stepping = Checking(check=True)
    simulate(reqs, 4, SPEC, cost, stepping, bulk=False)
    replicas.clear()
    policy = Checking(check=False)
    sim = simulate(reqs, 4, SPEC, cost, policy)
    assert len(policy.seen) == 150 and len(sim.records) == 150
    assert policy.seen == stepping.seen
    assert sim.num_bulk_steps > 0
    assert max(max(t[3] for t in rep.timeline) for rep in sim.replicas) > 1  # loads varied


def test_find_replicas_bisects_to_the_fewest_that_keep_up(tmp_path):
    """One sequence at a time, 10 steps of 10 ms a request: a replica serves 10 req/s.
    35 req/s at constant gaps round robin: 3 replicas fall behind (the queue, and TTFT,
    grow through the run: the last quarter misses), 4 keep up."""
    cost = tmp_path / "cost.json"
    _const(0.01).save(cost)
    out = tmp_path / "find.json"
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--cost-model", str(cost),
                           "--num-blocks", "64", "--max-num-seqs", "1", "--find-replicas",
                           "1:9", "--request-rate", "35", "--arrival", "constant",
                           "--num-prompts", "200", "--input-len", "10", "--output-len", "10",
                           "--vocab-size", "1000", "--slo-ttft-ms", "200", "--slo-tpot-ms",
                           "100", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    search = doc["replica_search"]
    assert search["num_replicas"] == 4 and doc["sim"]["num_replicas"] == 4
    tried = {t["num_replicas"]: t for t in search["tried"]}
    assert tried[4]["meets"] and not tried[3]["meets"]
    assert doc["ttft_ms"]["p50"] == pytest.approx(10.0)
    q3 = tried[3]["ttft_p50_ms_by_quarter"]
    assert q3 == sorted(q3) and q3[-1] > 200 > q3[0]  # the queue grows through the run
    assert "fewest replicas" in proc.stdout and ": 4" in proc.stdout


@pytest.mark.parametrize("flags, named", [
    (["--find-replicas", "5:2", "--request-rate", "1"], "--find-replicas"),
    (["--find-replicas", "1:4", "--sweep-rates", "1,2"], "--find-replicas"),
    (["--num-replicas", "0", "--request-rate", "1"], "--num-replicas"),
])
def test_bad_fleet_flags_exit_2_naming_the_flag(tmp_path, flags, named):
    cost = tmp_path / "cost.json"
    _const(0.01).save(cost)
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--cost-model", str(cost),
                           "--num-blocks", "64", *flags, "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_skipping_the_cache_lookup_for_a_policy_that_ignores_it_changes_nothing():
    """The simulator looks the prompt up in every replica's prefix cache only for a policy
    that reads cached_tokens: least_loaded told it reads them gives the same run."""
    import random

    from servelm.router.policies import make_policy
    from servelm.engine.step_cost_model import StepCostModel
    from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate

    class Reads:
        reads_cached_tokens = True

        def __init__(self):
            self.inner = make_policy("least_loaded")
            self.seen_cached = 0

        def pick(self, loads, request):
            self.seen_cached += sum(x.cached_tokens for x in loads)
            return self.inner.pick(loads, request)

    rng = random.Random(5)
    shared = [rng.randrange(100, 900) for _ in range(64)]
    reqs = [SimRequest(i * 0.01, shared + [rng.randrange(100, 900) for _ in range(20)], 8)
            for i in range(80)]
    cost = StepCostModel("t", base_s=0.003, per_decode_token_s=1e-4, per_prefill_token_s=3e-5)
    spec = ReplicaSpec(num_blocks=400, block_size=16)
    reads = Reads()
    a = simulate(reqs, 4, spec, cost, reads)
    b = simulate(reqs, 4, spec, cost, make_policy("least_loaded"))
    assert reads.seen_cached > 0  # the lookups ran, and found the shared prefix
    key = lambda r: (r.sent_time, r.first_token_time, r.end_time, tuple(r.chunk_times))
    assert list(map(key, a.records)) == list(map(key, b.records))
    assert [r.runner.busy_s for r in a.replicas] == [r.runner.busy_s for r in b.replicas]
