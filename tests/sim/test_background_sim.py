"""A batch backlog beside interactive traffic in the simulator, under the SLO policy's
rationing of background work (servelm/engine/slo_policy.py `hold`): the record `servelm
bench batch-knee` takes on a server, on a virtual clock. Interactive goodput with the
backlog stays within 5 points of the same traffic without it, where the policy without its
rationing loses more; with the step-cost model and from measured step times alone (a server
without --slo-cost-model); and the whole backlog still finishes."""

from __future__ import annotations

import random

import pytest

from servelm.engine.slo_policy import SLOPolicy
from servelm.engine.step_cost_model import StepCostModel
from servelm.router.policies import make_policy
from servelm.sim import fleet
from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate
from servelm.slo import SLOSpec, goodput_by_class

SPEC = SLOSpec.from_dict({"classes": [
    {"name": "interactive", "priority": 0, "ttft_ms": 500, "tpot_ms": 25, "percentile": 90,
     "reject_early": False},
    {"name": "batch", "priority": 1, "ttft_ms": 3600000, "tpot_ms": 60000, "percentile": 50,
     "reject_early": False}], "default_class": "interactive"})
# a CPU-like engine: each decode row costs as much as 6 prompt tokens
COST = StepCostModel("cpu-like", base_s=0.004, per_seq_s=1e-4, per_decode_token_s=6e-4,
                     per_decode_context_s=2e-7, per_prefill_token_s=1e-4)
REPLICA = ReplicaSpec(num_blocks=4096, block_size=16, max_num_seqs=32,
                      max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000,
                      scheduling_policy="slo")
RATE, SPAN, NUM_BATCH = 6.0, 40.0, 300


def _workload(with_batch: bool) -> tuple[list[SimRequest], list[str]]:
    """Poisson interactive arrivals for SPAN s; the batch backlog's lines all at 1 s (as
    the batch runner would submit them, at most 8 at a time, is not modelled: the
    engine holds them all)."""
    rng = random.Random(11)
    reqs, t = [], 0.0
    while True:
        t += rng.expovariate(RATE)
        if t >= SPAN:
            break
        reqs.append((t, "interactive", rng.randint(130, 500), rng.randint(64, 128)))
    if with_batch:
        reqs += [(1.0 + i * 1e-6, "batch", rng.randint(130, 500), rng.randint(64, 128))
                 for i in range(NUM_BATCH)]
    reqs.sort()
    out = []
    for t, cls, n_in, n_out in reqs:
        r = SimRequest(t, [rng.randrange(100, 1000) for _ in range(n_in)], n_out)
        r.slo = SPEC.get(cls).request_slo()
        out.append(r)
    return out, [c for _, c, _, _ in reqs]


def _goodput(with_batch: bool) -> tuple[float, list]:
    reqs, classes = _workload(with_batch)
    sim = simulate(reqs, 1, REPLICA, COST, make_policy("least_loaded"))
    by = goodput_by_class(SPEC, sim.records, classes)
    batch = [r for r, c in zip(sim.records, classes) if c == "batch"]
    return by["interactive"]["goodput"], batch


def _unrationed(monkeypatch) -> None:
    monkeypatch.setattr(SLOPolicy, "hold", lambda self, running, waiting: None)
    monkeypatch.setattr(SLOPolicy, "rations", lambda self, running, waiting: False)


@pytest.mark.parametrize("model", [True, False], ids=["cost-model", "measured"])
def test_interactive_goodput_beside_a_batch_backlog_stays_within_five_points(
        monkeypatch, model):
    if not model:  # the replicas' policy predicts nothing: a server without a cost model
        monkeypatch.setattr(fleet, "step_time_of", lambda cost: None)
    alone, _ = _goodput(False)
    assert alone >= 0.9  # the traffic alone is below the knee
    beside, batch = _goodput(True)
    assert beside >= alone - 0.05
    assert all(r.is_ok and r.num_output_tokens == r.max_tokens for r in batch)
    _unrationed(monkeypatch)
    free, batch = _goodput(True)
    assert free < alone - 0.05  # the backlog takes the interactive steps' time
    assert all(r.is_ok for r in batch)
