"""The batch backlog as the controller reads it: a replica's batch gauges (its runner's) parsed
into the policy's BatchDemand, pending lines due at the replica's earliest window and the
replicas' mean line rate."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from servelm.autoscale.controller import parse_batch_demand
from servelm.autoscale.policy import BatchBacklog, BatchDemand
from servelm.server.batch_input import BatchLine
from servelm.server.batch_pacer import BatchPacer
from servelm.server.batch_runner import BatchLimits, BatchRunner, _Job


def _page(jobs: list[tuple[int, float, float | None]], now: float = 1000.0) -> str:
    """A replica's /metrics with its runner holding jobs of (lines left, window end, measured
    line seconds or None)."""
    registry = CollectorRegistry()
    runner = BatchRunner({}, None, None, "batch", "m", BatchLimits(max_inflight=8),
                         registry=registry, clock=lambda: now)
    for i, (num_lines, expires_at, line_s) in enumerate(jobs):
        job = _Job({"id": f"b{i}", "expires_at": expires_at}, BatchPacer(10.0))
        job.lines = [BatchLine(k + 1, f"c{k}", {}) for k in range(num_lines)]
        if line_s is not None:
            job.pacer.observe(line_s)
        runner._jobs[job.id] = job
    return generate_latest(registry).decode()


def test_the_runners_gauges_read_as_the_policys_batch_demand():
    busy = _page([(300, 1000.0 + 7200, 4.0), (50, 1000.0 + 3600, None)])
    other = _page([(100, 1000.0 + 86_400, 2.0)])
    idle = _page([])
    demand = parse_batch_demand([busy, other, idle, "not a metrics page {"])
    # each replica's lines due at its earliest window; rates: 8 seats / 4 s and / 2 s
    assert demand == BatchDemand((BatchBacklog(350, 3600.0), BatchBacklog(100, 86_400.0)),
                                 line_rate=3.0)


def test_no_lines_held_is_no_demand_and_no_rate_is_none():
    assert parse_batch_demand([_page([]), _page([(0, 5000.0, 1.0)])]) is None
    demand = parse_batch_demand([_page([(10, 1600.0, None)])])
    assert demand == BatchDemand((BatchBacklog(10, 600.0),), None)
