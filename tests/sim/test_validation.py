"""The simulator against measured runs: replaying recorded `servelm bench serve` runs of the
default model with the step-cost model calibrated on the same engine.

The record of `servelm sim validate` (tests/sim/data/validation-record/, or the folder
SERVELM_SIM_VALIDATION_RECORD names) is held to the accepted bar (docs/sim.md): below the
knee every TTFT / TPOT percentile within 15% of the measured runs' median, at the knee
inside their range, past it goodput within 10 points, the knee rate within 10%. The older
single-run record (benchmarks/cpu/run_sim_validation.sh: validation-light / -knee.jsonl)
is held to TTFT and TPOT medians within 15%."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from servelm.bench.sweep import goodput_crossing
from servelm.sim import validation as V
from servelm.sim.validate_cli import simulate_cli

from servelm.router.policies import make_policy
from servelm.bench.request_trace import read_trace
from servelm.sim.arrivals import trace_prompts
from servelm.sim.cli import replica_spec
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import SimRequest, simulate

DATA = Path(__file__).parent / "data"
COST_MODEL = DATA / "validation-cost-model.json"
TOLERANCE = 0.15  # the simulator's bar: within 15% of measured at light load and the knee


class _NoOverrides:
    """replica_spec's flags, none given: the calibrated engine is the replica."""

    num_blocks = block_size = max_num_seqs = max_num_batched_tokens = max_model_len = None
    no_prefix_cache = False
    vocab_size = 49152


@pytest.mark.parametrize("name", ["light", "knee"])
def test_the_simulation_of_a_recorded_run_is_within_tolerance(name):
    trace_path = DATA / f"validation-{name}.jsonl"
    if not (trace_path.is_file() and COST_MODEL.is_file()):
        pytest.skip(f"no recorded run in {DATA} (validation-{name}.jsonl and "
                    f"validation-cost-model.json): run benchmarks/cpu/run_sim_validation.sh "
                    f"alone on the machine to record one")
    cost = StepCostModel.load(COST_MODEL)
    spec = replica_spec(_NoOverrides(), cost)
    trace = read_trace(trace_path)
    measured = [t for t in trace if not t.measured.get("error")]
    assert len(measured) >= 0.9 * len(trace), "the recorded run itself mostly failed"
    prompts = trace_prompts(trace, spec.vocab_size)
    reqs = [SimRequest(t.arrival_s, p, t.num_replay_tokens) for t, p in zip(trace, prompts)]
    sim = simulate(reqs, 1, spec, cost, make_policy("round_robin"))
    assert len(sim.records) == len(trace) and all(r.is_ok for r in sim.records)
    for key, sim_values in (("ttft_s", [r.ttft_s for r in sim.records]),
                            ("tpot_s", [r.tpot_s for r in sim.records if r.tpot_s])):
        got = statistics.median(sim_values)
        want = statistics.median(t.measured[key] for t in measured if t.measured.get(key))
        assert abs(got - want) <= TOLERANCE * want, \
            f"{name}: simulated {key} p50 {got * 1e3:.1f} ms, measured {want * 1e3:.1f} ms"


# The record `servelm sim validate` ships when the bar is met (docs/sim.md, "The accepted
# bar"): the model, one trace per point (without prompt ids), the measured runs' medians
# and ranges, and the shipped variant's drift scales. SERVELM_SIM_VALIDATION_RECORD=<a
# record's ci/ folder> replays another one.
RECORD = Path(os.environ.get("SERVELM_SIM_VALIDATION_RECORD", DATA / "validation-record"))


def _record() -> dict:
    if not (RECORD / "record.json").is_file():
        pytest.skip(f"no validation record in {RECORD}: `servelm sim validate`, run alone on "
                    f"the machine, ships one when it meets the bar")
    return json.loads((RECORD / "record.json").read_text())


def _slo_flags(plan: dict) -> list[str]:
    return ["--cost-model", str(RECORD / "cost-model.json"),
            "--slo-ttft-ms", str(plan["slo_ttft_ms"]), "--slo-tpot-ms", str(plan["slo_tpot_ms"]),
            "--goodput-target", str(plan["goodput_target"])]


@pytest.mark.parametrize("point", [p.name for p in V.POINTS])
def test_the_record_replays_within_the_bar(point):
    record = _record()
    if point not in record["points"]:
        pytest.skip(f"the record has no {point} point")
    p = record["points"][point]
    # The shipped variant's answer: the median of one simulation per measured run, each at
    # its run's drift scale (the calibrated model alone: one scale, 1).
    sims = [simulate_cli([*_slo_flags(record["plan"]), "--trace", str(RECORD / p["trace"]),
                          "--cost-scale", f"{scale:.4f}"])[0]
            for scale in p.get("scales", [1.0])]
    got = V.compare(p["measured"], V.simulated_values(sims), p["rule"])
    misses = {k: tuple(round(r[x], 1) for x in ("simulated", "median", "min", "max"))
              for k, r in got["percentiles"].items()
              if (p["rule"] == "median" and abs(r["error"]) > V.MEDIAN_TOLERANCE)
              or (p["rule"] == "range" and not r["in_range"])}
    assert got["met"], f"{point} ({p['rule']}, {record.get('variant', 'base')}): " \
        f"{misses or got['goodput']}"


def test_the_record_replays_the_knee_rate_within_the_bar():
    record = _record()
    knee, plan = record["knee_rate"], record["plan"]
    if not knee:
        pytest.skip("the record was made at a given knee, without a sweep")
    scales = knee.get("scales") or [1.0] * len(knee["rates"])
    sims = [simulate_cli([*_slo_flags(plan), "--request-rate", f"{rate:g}", "--num-prompts",
                          str(plan["sweep_prompts"]), "--input-len", plan["input_len"],
                          "--output-len", plan["output_len"], "--seed", "0",
                          "--cost-scale", f"{scale:.4f}"])[0]
            for rate, scale in zip(knee["rates"], scales)]
    crossing = goodput_crossing(knee["rates"], [s["goodput"] for s in sims],
                                plan["goodput_target"])
    assert V.knee_rate(knee["measured_req_s"], crossing)["met"], \
        f"simulated knee {crossing}, measured {knee['measured_req_s']} req/s"
