"""Arrivals the simulator adds: gamma-bursty gaps (mean rate and CV, statistically) and the
replay of a JSONL trace (`servelm bench serve --record-requests`), whose send times,
prompts and output lengths the simulation reproduces exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from servelm.router.policies import make_policy
from servelm.sim import cli as sim_cli
from servelm.bench.request_trace import TraceError, read_trace, trace_line
from servelm.sim.arrivals import gamma_offsets
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import ReplicaSpec, simulate

SPEC = ReplicaSpec(num_blocks=512, block_size=16, max_num_seqs=32,
                   max_num_batched_tokens=512, max_model_len=4096, vocab_size=1000)
COST = StepCostModel("lin", base_s=0.004, per_decode_token_s=0.0005,
                     per_prefill_token_s=0.00005)


def _sim_args(*flags: str):
    import argparse

    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["sim", "--cost-model", "unused.json", *flags])


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_gaps_have_the_mean_rate_and_the_cv_asked_for(cv):
    rate, n = 20.0, 40_000
    t = gamma_offsets(n, rate, cv, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    # Standard errors at n = 40,000: mean 0.25-1.5%, CV under 2% (shape 1/9 is heavy-tailed).
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_bursty_gaps_bunch_up_more_than_poisson():
    rate, n = 10.0, 20_000
    poisson, bursty = (np.diff(gamma_offsets(n, rate, cv, seed=1)) for cv in (1.0, 3.0))
    # The same mean, but a bursty stream has far more near-simultaneous arrivals.
    short = 0.01 / rate
    assert (bursty < short).mean() > 5 * (poisson < short).mean()


def test_gamma_arrivals_are_the_simulated_send_times():
    args = _sim_args("--request-rate", "8", "--arrival", "gamma", "--burstiness", "2.5",
                     "--num-prompts", "60", "--input-len", "20:80", "--output-len", "4:12",
                     "--vocab-size", "1000", "--seed", "5")
    assert sim_cli.check_load_flags(args) == [8.0]
    reqs = sim_cli.build_requests(args, 8.0)
    assert [r.arrival_s for r in reqs] == pytest.approx(list(gamma_offsets(60, 8.0, 2.5, 5)))
    sim = simulate(reqs, 2, SPEC, COST, make_policy("least_loaded"))
    assert sorted(r.sent_time for r in sim.records) == pytest.approx(
        sorted(r.arrival_s for r in reqs))


def _write_trace(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_a_replayed_trace_keeps_its_times_prompts_and_output_lengths(tmp_path):
    shared = list(range(300, 364))  # 4 blocks every prompt of the second half starts with
    lines, expect = [], []
    rng = np.random.default_rng(0)
    t = 0.0
    for i in range(40):
        t += float(rng.exponential(0.05))
        n_out = int(rng.integers(2, 20))
        if i % 2:
            ids = shared + [int(x) for x in rng.integers(100, 900, size=int(rng.integers(5, 50)))]
            lines.append(trace_line(t, ids, 32, n_out, {"ttft_s": 0.1, "error": None}))
            expect.append((t, len(ids), n_out))
        elif i % 4 == 0:  # no ids: a prompt of its own, of the recorded length
            lines.append(json.dumps({"arrival_s": t, "num_prompt_tokens": 70,
                                     "max_tokens": n_out}))
            expect.append((t, 70, n_out))
        else:  # failed: replayed with what it asked for
            lines.append(trace_line(t, [5] * 30, 9, 0, {"error": "http_500"}))
            expect.append((t, 30, 9))
    path = tmp_path / "trace.jsonl"
    _write_trace(path, lines)
    args = _sim_args("--trace", str(path), "--vocab-size", "1000")
    assert sim_cli.check_load_flags(args) == [None]
    reqs = sim_cli.build_requests(args, None)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.max_tokens) for r in reqs] == expect
    sim = simulate(reqs, 2, SPEC, COST, make_policy("round_robin"))
    got = sorted((r.sent_time, r.num_prompt_tokens, r.num_output_tokens) for r in sim.records)
    assert got == sorted(expect)
    cache_hits = sum(rep.engine.block_manager.prefix_cache.stats.num_hit_tokens
                     for rep in sim.replicas)
    assert cache_hits >= 64 * 10  # the recorded ids were replayed: the shared prefix hits


@pytest.mark.parametrize("line, message", [
    ('{"num_prompt_tokens": 5, "max_tokens": 3}', "'arrival_s'"),
    ('{"arrival_s": -1, "num_prompt_tokens": 5, "max_tokens": 3}', "'arrival_s'"),
    ('{"arrival_s": 0, "max_tokens": 3}', "'num_prompt_tokens'"),
    ('{"arrival_s": 0, "num_prompt_tokens": 5, "max_tokens": 0}', "'max_tokens'"),
    ('{"arrival_s": 0, "prompt_token_ids": [1, 2], "num_prompt_tokens": 3, '
     '"max_tokens": 2}', "'num_prompt_tokens'"),
    ('not json', "not JSON"),
])
def test_a_bad_trace_line_is_an_error_naming_the_line_and_key(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    _write_trace(path, [trace_line(0.0, [1, 2, 3], 4, 4), line])
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert "line 2" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("flags, named", [
    (["--request-rate", "2", "--burstiness", "2"], "--burstiness"),
    (["--request-rate", "2", "--arrival", "gamma", "--burstiness", "0"], "--burstiness"),
    (["--request-rate", "0"], "--request-rate"),
    (["--sweep-rates", "1,x"], "--sweep-rates"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
])
def test_bad_load_flags_exit_2_naming_the_flag(tmp_path, flags, named):
    cost = tmp_path / "cost.json"
    COST.save(cost)
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--cost-model",
                           str(cost), "--num-blocks", "64", *flags, "--out",
                           str(tmp_path / "o.json")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_bench_serve_records_a_trace_that_sim_replays(tmp_path):
    """A measured run against the fake server, recorded per request, then simulated: the
    simulated requests are sent at the recorded offsets with the recorded prompts."""
    from servelm.bench.cli import main
    from servelm.bench.fake_server import FakeBehaviour, FakeServer
    from servelm.bench.serve import build_workload

    trace = tmp_path / "trace.jsonl"
    with FakeServer(FakeBehaviour(ttft_s=0.02, tpot_s=0.005)) as server:
        rc = main(["serve", "--base-url", server.url, "--model", "fake", "--request-rate",
                   "40", "--num-prompts", "16", "--warmup", "0", "--input-len", "8:40",
                   "--output-len", "3:6", "--vocab-size", "1000", "--seed", "2", "--out",
                   str(tmp_path / "r.json"), "--record-requests", str(trace),
                   "--no-progress"])
    assert rc == 0
    recorded = read_trace(trace)
    sent = build_workload("random", 16, "8:40", "3:6", 1000, 2)
    assert [r.prompt_token_ids for r in recorded] == [r.prompt_token_ids for r in sent]
    assert [r.num_output_tokens for r in recorded] == [r.max_tokens for r in sent]
    offsets = [r.arrival_s for r in recorded]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] > 0
    assert all(r.measured["ttft_s"] >= 0.02 for r in recorded)
    args = _sim_args("--trace", str(trace), "--vocab-size", "1000")
    sim = simulate(sim_cli.build_requests(args, None), 1, SPEC, COST,
                   make_policy("round_robin"))
    assert sorted((r.sent_time, r.num_prompt_tokens, r.num_output_tokens)
                  for r in sim.records) == \
        sorted((r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in recorded)


def test_bench_serve_refuses_to_record_a_sweep(tmp_path, capsys):
    from servelm.bench.cli import main

    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--sweep-rates", "1,2",
               "--record-requests", str(tmp_path / "t.jsonl"), "--no-progress"])
    assert rc == 2 and "--record-requests" in capsys.readouterr().err


def test_a_prompt_the_server_counted_differently_is_recorded_by_its_served_length(tmp_path):
    """Text and chat prompts are tokenized by the server: the trace keeps the length the
    server reported (usage.prompt_tokens), not the workload's ids."""
    from servelm.bench.metrics import RequestRecord
    from servelm.bench.serve import record_requests
    from servelm.bench.workloads import Request

    reqs = [Request([7] * 10, 5), Request([8] * 12, 6)]
    recs = [RequestRecord(10, 5, scheduled_time=100.0, sent_time=100.0, first_token_time=100.1,
                          end_time=100.5, num_output_tokens=5, usage_prompt_tokens=10),
            RequestRecord(12, 6, scheduled_time=100.25, sent_time=100.25,
                          first_token_time=100.4, end_time=101.0, num_output_tokens=6,
                          usage_prompt_tokens=31)]
    path = tmp_path / "t.jsonl"
    record_requests(str(path), reqs, recs)
    a, b = read_trace(path)
    assert (a.arrival_s, a.prompt_token_ids, a.num_output_tokens) == (0.0, [7] * 10, 5)
    assert (b.arrival_s, b.prompt_token_ids, b.num_prompt_tokens) == (0.25, None, 31)
    assert b.measured["ttft_s"] == pytest.approx(0.15)
