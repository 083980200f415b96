"""`servelm sim --gpu` and `servelm plan fleet` on one model of the machine: the 70B fleet for
10,000 req/s on 8 x H100-SXM (docs/sim.md, "Where the planner and the simulator part").

At light load the two tools agree: a request's TTFT is its prefill (`plan prefill`) and its
TPOT a decode step of the few sequences running (`plan decode`). At the load the plan sizes
the fleet for they part, and the test says which way and why: queueing and prefill chunks
sharing the decode steps, which the planner's arithmetic does not model."""

from __future__ import annotations

import pytest

from servelm.planner.calibration import load_calibration
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.fleet import Workload, plan_fleet, size_replica
from servelm.planner.hardware import get_accelerator
from servelm.planner.model_catalog import resolve_model
from servelm.planner.prefill import max_chunk
from servelm.sim.validate_cli import simulate_cli

WORKLOAD = Workload(rps=10_000, input_len=2000, output_len=300, ttft_s=1.0, tpot_s=0.05)
AGREEMENT = 0.10  # the two tools at light load


@pytest.fixture(scope="module")
def plan():
    d = Deployment(resolve_model("Llama-3.1-70B"), get_accelerator("H100-SXM"), tp=8,
                   calibration=load_calibration(None))
    fleet = plan_fleet(d, WORKLOAD, tp_fixed=True)
    return d, fleet, size_replica(d, WORKLOAD, d.calibration.prefill_mfu)


def _chunk(d: Deployment, batch: int) -> int:
    """The prompt chunk a step of the full decode batch can carry within the TPOT SLO
    (`servelm plan prefill --tpot 0.05 --batch 555 --context 2150`: 814 tokens)."""
    context = WORKLOAD.input_len + WORKLOAD.output_len // 2
    return max_chunk(d, batch, context, WORKLOAD.input_len, WORKLOAD.tpot_s,
                     d.calibration.prefill_mfu).max_chunk_tokens


def _simulate(d: Deployment, rate: float, num_prompts: int, decode_batch: int) -> dict:
    """One replica as the plan sizes it: its decode batch as max_num_seqs, and a step budget
    of that batch plus the chunk the TPOT allows (docs/sim.md)."""
    chunk = _chunk(d, decode_batch)
    return simulate_cli(["--gpu", "H100-SXM", "--model", "Llama-3.1-70B", "--tp", "8",
                         "--request-rate", f"{rate:g}", "--num-prompts", str(num_prompts),
                         "--input-len", str(WORKLOAD.input_len),
                         "--output-len", str(WORKLOAD.output_len),
                         "--max-num-seqs", str(decode_batch),
                         "--max-num-batched-tokens", str(decode_batch + chunk),
                         "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"])[0]


def test_the_plan_is_the_one_the_docs_compare(plan):
    d, fleet, size = plan
    assert fleet.decode_batch == 555 and fleet.num_replicas == 1029
    assert size.prefill_s == pytest.approx(0.0716, rel=0.01)
    assert _chunk(d, fleet.decode_batch) == 814


def test_at_light_load_the_simulator_gives_the_planners_ttft_and_tpot(plan):
    d, fleet, size = plan
    rate = fleet.replica_rps / 50  # a replica at 2% of its planned capacity
    sim = _simulate(d, rate, 60, fleet.decode_batch)
    context = WORKLOAD.input_len + WORKLOAD.output_len / 2
    planned_tpot = step_time(d, 1, context).step_s
    assert sim["ttft_ms"]["p50"] / 1e3 == pytest.approx(size.prefill_s, rel=AGREEMENT)
    assert sim["tpot_ms"]["p50"] / 1e3 == pytest.approx(planned_tpot, rel=AGREEMENT)


def test_at_the_planned_load_they_part_by_queueing_and_batching(plan):
    d, fleet, size = plan
    rate = WORKLOAD.rps / fleet.num_replicas  # each replica's share of 10,000 req/s
    sim = _simulate(d, rate, 600, fleet.decode_batch)
    context = WORKLOAD.input_len + WORKLOAD.output_len / 2
    # Queueing: a prompt that arrives while another's chunks run waits for them.
    assert sim["ttft_ms"]["p50"] / 1e3 > (1 + AGREEMENT) * size.prefill_s
    # Batching: the replica runs the sequences Little's law gives, far fewer than the
    # planner's decode batch, so TPOT is below its decode step at that batch ...
    running = rate * sim["e2e_ms"]["mean"] / 1e3
    assert running < fleet.decode_batch / 5
    assert sim["tpot_ms"]["p50"] / 1e3 < size.decode_step_s
    # ... but well above a decode step of the sequences running: most steps carry a
    # prompt's chunk, whose compute every decode in that step waits for.
    assert sim["tpot_ms"]["p50"] / 1e3 > 1.5 * step_time(d, round(running), context).step_s
