"""The autoscaler in the simulator: replicas boot before they serve, drain before they go,
nothing is dropped, replica time is what was paid; the diurnal day has its shape."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from servelm.autoscale.policy import AutoscaleConfig
from servelm.router.policies import make_policy
from servelm.sim.autoscale import (
    diurnal_arrivals,
    diurnal_requests,
    diurnal_share,
    simulate_autoscaled,
)
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import ReplicaSpec, SimRequest

SPEC = ReplicaSpec(num_blocks=1024, block_size=16, max_num_seqs=16,
                   max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000)
COST = StepCostModel("linear", base_s=0.02, per_decode_token_s=0.001,
                     per_prefill_token_s=0.0002)


def _load(rates: list[tuple[float, float]], seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at each (seconds, rate) phase in turn; 64-token prompts, 32 out."""
    rng = np.random.default_rng(seed)
    out, t0 = [], 0.0
    for seconds, rate in rates:
        t = t0
        while True:
            t += rng.exponential(1 / rate)
            if t >= t0 + seconds:
                break
            out.append(SimRequest(t, [int(x) for x in rng.integers(100, 900, 64)], 32))
        t0 += seconds
    return out


CONFIG = AutoscaleConfig(target=150, min_replicas=1, max_replicas=6, up_window_s=5,
                         down_cooldown_s=30, tick_s=1, boot_s=10)


def test_a_ramp_scales_up_and_down_and_drops_nothing():
    reqs = _load([(60, 2), (120, 20), (200, 0.5)])
    res = simulate_autoscaled(reqs, SPEC, COST, make_policy("least_loaded"), CONFIG)
    assert len(res.records) == len(reqs)
    assert all(r.is_ok and r.num_output_tokens == 32 for r in res.records)
    ups = [e for e in res.events if e.delta > 0]
    downs = [e for e in res.events if e.delta < 0]
    assert ups and downs
    assert 60 <= ups[0].time_s < 60 + 20  # within the up window (+ a tick or two) of the rise
    # After the load drops at 180 s, the first scale-down waits out the cool-down.
    assert min(e.time_s for e in downs if e.time_s >= 180) >= 180 + CONFIG.down_cooldown_s
    # Up, then down: no up after a down, no down between ups (no oscillation).
    signs = [e.delta > 0 for e in res.events]
    assert signs == sorted(signs, reverse=True)
    assert 1 < res.max_replicas <= CONFIG.max_replicas
    final = res.timeline[-1]
    assert final.num_ready + final.num_booting == 1


def test_booting_replicas_get_no_request_before_they_are_ready():
    reqs = _load([(30, 1), (60, 25)])
    res = simulate_autoscaled(reqs, SPEC, COST, make_policy("round_robin"), CONFIG)
    ordered = [(e.time_s, e.delta) for e in res.events if e.delta > 0]
    assert ordered
    # The first replica ordered comes up boot_s after the order: before that, 1 serves.
    t_order = ordered[0][0]
    for s in res.timeline:
        if t_order < s.time_s < t_order + CONFIG.boot_s:  # a tick samples, then orders
            assert s.num_ready == 1 and s.num_booting >= 1
    assert any(s.num_ready > 1 for s in res.timeline if s.time_s >= t_order + CONFIG.boot_s)


def test_replica_time_of_a_fixed_fleet_is_its_size_times_the_run():
    fixed = AutoscaleConfig(target=150, min_replicas=2, max_replicas=2, tick_s=1, boot_s=10)
    reqs = _load([(100, 5)])
    res = simulate_autoscaled(reqs, SPEC, COST, make_policy("least_loaded"), fixed)
    assert res.events == []
    assert res.replica_s == pytest.approx(2 * res.elapsed_s)


def test_utilization_saturates_where_tokens_in_flight_does_not():
    """The same load at 2 and 20 req/s: a replica busy stepping reads about 1 either way
    once it has any work, while tokens in flight grows with the work."""
    for signal in ("utilization", "tokens_in_flight"):
        cfg = AutoscaleConfig(target=1e9 if signal == "tokens_in_flight" else 100.0,
                              signal=signal, min_replicas=1, max_replicas=1, tick_s=1)
        lo = simulate_autoscaled(_load([(60, 6)]), SPEC, COST, make_policy("round_robin"), cfg)
        hi = simulate_autoscaled(_load([(60, 30)]), SPEC, COST, make_policy("round_robin"), cfg)
        mean = lambda r: float(np.mean([s.signal for s in r.timeline[10:50]]))
        if signal == "utilization":
            assert 0.9 < mean(lo) <= 1.0 and 0.9 < mean(hi) <= 1.0
        else:
            assert mean(hi) > 5 * mean(lo)


def test_diurnal_day_has_its_shape():
    hour_s = 100.0
    t = diurnal_arrivals(10.0, hour_s, seed=1)
    per_hour = np.bincount((t // hour_s).astype(int), minlength=24)
    assert len(per_hour) == 24
    expected = [10.0 * hour_s * np.mean([diurnal_share(h + k / 100) for k in range(100)])
                for h in range(24)]
    for n, e in zip(per_hour, expected):
        assert abs(n - e) < 4 * np.sqrt(e) + 5
    assert per_hour.argmin() in (3, 4, 5) and per_hour[10] > per_hour[9]  # trough, a spike
    reqs = diurnal_requests(10.0, hour_s, "32", "10", 1000, seed=1)
    evening = [r.max_tokens for r in reqs if 19 * hour_s <= r.arrival_s < 22 * hour_s]
    morning = [r.max_tokens for r in reqs if 7 * hour_s <= r.arrival_s < 9 * hour_s]
    assert set(morning) == {10} and set(evening) == {20}
    with pytest.raises(ValueError, match="--hour-s"):
        diurnal_arrivals(10.0, 0.0)


def _sim(*argv: str):
    return subprocess.run([sys.executable, "-m", "servelm.cli", "sim", *argv],
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_autoscale_run_and_its_errors(tmp_path):
    cost = tmp_path / "cost.json"
    COST.save(cost)
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"target": 100, "max_replicas": 3, "up_window_s": 2,
                                  "down_cooldown_s": 5, "tick_s": 0.5, "boot_s": 1}))
    out = tmp_path / "a.json"
    common = ["--cost-model", str(cost), "--num-blocks", "1024", "--request-rate", "12",
              "--input-len", "32:64", "--output-len", "16:32"]
    r = _sim(*common, "--arrival", "diurnal", "--hour-s", "4", "--autoscale", str(policy),
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    a, s = doc["autoscaled"], doc["static"]
    assert a["num_failed"] == 0 and a["num_requests"] == doc["workload"]["num_prompts"]
    assert s["num_replicas"] == 3 and a["replica_hours"] < s["replica_hours"]
    assert doc["replica_hours_saved"] == pytest.approx(
        1 - a["replica_hours"] / s["replica_hours"])
    assert a["num_scale_events"] == len(a["events"]) > 0
    assert out.with_suffix(".png").exists()

    r = _sim(*common, "--autoscale", str(policy))
    assert r.returncode == 2 and "--arrival diurnal" in r.stderr
    policy.write_text(json.dumps({"target": 300, "max_replica": 3}))
    r = _sim(*common, "--arrival", "diurnal", "--autoscale", str(policy))
    assert r.returncode == 2 and "max_replica" in r.stderr


def test_scale_to_zero_holds_the_first_request_and_drops_nothing():
    """Work, then an hour without any, then work again: the fleet goes to zero replicas in
    the gap, the next request is held (not dropped) while a replica boots, and waits boot_s."""
    zero = AutoscaleConfig(target=150, min_replicas=0, max_replicas=4, up_window_s=5,
                           down_cooldown_s=30, tick_s=1, boot_s=10)
    first = _load([(60, 2)])
    later = [SimRequest(r.arrival_s + 3600, r.prompt_token_ids, r.max_tokens)
             for r in _load([(30, 2)], seed=1)]
    res = simulate_autoscaled(first + later, SPEC, COST, make_policy("least_loaded"), zero)
    assert len(res.records) == len(first) + len(later)
    assert all(r.is_ok and r.num_output_tokens == 32 for r in res.records)
    idle = [s for s in res.timeline if 200 < s.time_s < 3500]
    assert idle and all(s.num_ready + s.num_booting == 0 for s in idle)
    assert any(e.reason == "idle" for e in res.events)
    # The day starts at zero too: the very first request wakes a replica, and so does the
    # first one after the gap.
    wakes = [e for e in res.events if e.reason == "wake"]
    assert len(wakes) == 2 and wakes[0].time_s <= first[0].arrival_s + zero.tick_s
    assert later[0].arrival_s <= wakes[1].time_s <= later[0].arrival_s + zero.tick_s
    by_arrival = sorted(res.records, key=lambda r: r.scheduled_time)
    for held in (by_arrival[0], by_arrival[len(first)]):  # each waited out a boot
        assert held.ttft_s >= zero.boot_s - zero.tick_s


def test_a_batch_backlog_fed_to_the_simulated_policy_scales_the_fleet():
    from servelm.autoscale.policy import BatchBacklog, BatchDemand

    reqs = _load([(120, 2)])
    plain = simulate_autoscaled(reqs, SPEC, COST, make_policy("least_loaded"), CONFIG)
    # A backlog due at 100 s that two replicas' worth of lines a second would finish
    near = lambda t: BatchDemand((BatchBacklog(2_000, 100 - t),), line_rate=10.0)
    paced = simulate_autoscaled(reqs, SPEC, COST, make_policy("least_loaded"), CONFIG,
                                batch=near)
    assert len(paced.records) == len(reqs)
    assert paced.max_replicas > plain.max_replicas
    far = lambda t: BatchDemand((BatchBacklog(2_000, 86_400 - t),), line_rate=10.0)
    relaxed = simulate_autoscaled(reqs, SPEC, COST, make_policy("least_loaded"), CONFIG,
                                  batch=far)
    assert relaxed.max_replicas == plain.max_replicas
