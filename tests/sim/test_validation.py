"""The simulator against a measured run: replaying a recorded `servelm bench serve` run of
the default model on this machine (benchmarks/cpu/run_sim_validation.sh writes
tests/sim/data/) with the step-cost model calibrated on the same engine gives TTFT and TPOT
medians within 15% of the measured ones, at a light rate and at the knee."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from servelm.router.policies import make_policy
from servelm.sim.arrivals import read_trace, trace_prompts
from servelm.sim.cli import replica_spec
from servelm.sim.cost_model import StepCostModel
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
