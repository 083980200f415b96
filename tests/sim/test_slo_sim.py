"""The SLO spec and the SLO scheduling policy in the simulator and `servelm bench serve`:
per-class goodput in the result, bulk advance still equal to stepping under the policy, the
policy buying the interactive class goodput over FCFS on an overloaded mix (a refused
request counted as a failure, never dropped), and `bench serve --class-mix` sending the
same requests with the same classes that `servelm sim --class-mix` simulates."""

from __future__ import annotations

import json

import pytest

from servelm.bench.cli import main as bench_main
from servelm.bench.fake_server import FakeBehaviour, FakeServer
from servelm.bench.loadgen import EndpointConfig
from servelm.bench.serve import ClassRequest
from servelm.cli import main as servelm_main
from servelm.engine.step_cost_model import StepCostModel
from servelm.sim.fleet import ReplicaSpec, SimRequest
from servelm.bench.class_workload import class_workload
from servelm.slo import SLOSpec, parse_class_lengths, parse_class_mix

from test_bulk import COST, _random_requests, run_both

SPEC = {"classes": [
    {"name": "interactive", "priority": 0, "ttft_ms": 1000, "tpot_ms": 60, "percentile": 90},
    {"name": "batch", "priority": 1, "ttft_ms": 30000, "tpot_ms": 300, "percentile": 50,
     "reject_early": False}], "default_class": "interactive", "window_s": 60}
CPU_LIKE = {"kind": "step-cost-model", "name": "cpu-like", "base_s": 0.004, "per_seq_s": 1e-4,
            "per_decode_token_s": 3e-4, "per_decode_context_s": 2e-7,
            "per_prefill_token_s": 5e-5, "per_prefill_pair_s": 0.0, "fit": {}}
MIX = ["--class-mix", "interactive=0.7,batch=0.3", "--class-len", "interactive=64:256/32:64",
       "--class-len", "batch=1000:2000/128:256"]


@pytest.fixture()
def files(tmp_path):
    spec, cost = tmp_path / "slo.json", tmp_path / "cost.json"
    spec.write_text(json.dumps(SPEC))
    cost.write_text(json.dumps(CPU_LIKE))
    return spec, cost, tmp_path


def _sim(files, policy, rate, n=300):
    spec, cost, tmp = files
    out = tmp / f"sim-{policy}-{rate}.json"
    rc = servelm_main(["sim", "--cost-model", str(cost), "--num-blocks", "4096",
                       "--request-rate", str(rate), "--num-prompts", str(n), "--slo-spec",
                       str(spec), *MIX, "--scheduling-policy", policy, "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_the_slo_policy_buys_the_interactive_class_goodput_under_overload(files):
    fcfs, slo = _sim(files, "fcfs", 20), _sim(files, "slo", 20)
    f, s = fcfs["slo"]["by_class"], slo["slo"]["by_class"]
    assert fcfs["sim"]["scheduling_policy"] == "fcfs" and slo["sim"]["scheduling_policy"] == "slo"
    for by in (f, s):  # the same requests both times
        assert by["interactive"]["num_requests"] + by["batch"]["num_requests"] == 300
    assert f["interactive"]["num_requests"] == s["interactive"]["num_requests"]
    assert f["interactive"]["num_rejected"] == 0  # FCFS never refuses
    assert s["batch"]["num_rejected"] == 0  # reject_early false
    assert s["interactive"]["goodput"] > f["interactive"]["goodput"] + 0.5
    assert s["interactive"]["goodput"] >= 0.9  # the class meets its target
    assert s["batch"]["goodput"] >= 0.5  # batch still meets its (loose) target
    # A refused request is a failure in the overall result too, never a silent drop.
    refused = s["interactive"]["num_rejected"]
    assert slo["num_requests"] == 300
    assert slo["failures"] == ({"slo_unattainable": refused} if refused else {})


def test_bulk_advance_is_stepping_under_the_slo_policy():
    spec = SLOSpec.from_dict(SPEC)
    reqs = _random_requests(60, seed=3, span=2.0)
    for i, r in enumerate(reqs):
        r.slo = spec.get("interactive" if i % 3 else "batch").request_slo()
    replica = ReplicaSpec(num_blocks=300, block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=256, scheduling_policy="slo")
    stepped, bulk = run_both(reqs, 2, replica, "least_loaded")
    assert bulk.num_bulk_steps > 0
    assert stepped.replicas[0].engine.scheduler.policy is not None


def test_bench_serve_sends_the_classes_the_simulator_simulates(files, tmp_path):
    spec_path, _, _ = files
    spec = SLOSpec.load(spec_path)
    out = tmp_path / "serve.json"
    with FakeServer(FakeBehaviour(ttft_s=0.01, tpot_s=0.001)) as server:
        rc = bench_main(["serve", "--base-url", server.url, "--model", "fake",
                         "--vocab-size", "49152", "--request-rate", "200",
                         "--num-prompts", "20", "--warmup", "0",
                         "--slo-spec", str(spec_path), *MIX, "--out", str(out),
                         "--no-progress"])
    assert rc == 0
    by = json.loads(out.read_text())["slo"]["by_class"]
    _, classes = class_workload(20, parse_class_mix("interactive=0.7,batch=0.3", spec),
                                parse_class_lengths(MIX[3::2], spec), "128", "128", 49152, 0)
    assert by["interactive"]["num_requests"] == classes.count("interactive")
    assert by["batch"]["num_requests"] == classes.count("batch")
    body = EndpointConfig("http://x", "m").body(ClassRequest([5, 6], 3, "batch"))
    assert body["slo_class"] == "batch"


@pytest.mark.parametrize("flags, message", [
    (["--class-mix", "gold=1"], "--class-mix"),
    (["--class-len", "batch=1/1"], "--class-len: only with --class-mix"),
])
def test_bad_class_flags_name_the_flag(files, flags, message, capsys):
    spec, cost, tmp = files
    rc = servelm_main(["sim", "--cost-model", str(cost), "--num-blocks", "64",
                       "--request-rate", "1", "--num-prompts", "2", "--slo-spec", str(spec),
                       *flags, "--out", str(tmp / "x.json")])
    assert rc == 2 and message in capsys.readouterr().err


# -- the autoscaler reading the SLO spec ---------------------------------------------------

def _slo_config(tmp_path, spec=SPEC, **kw):
    from servelm.autoscale.policy import AutoscaleConfig

    path = tmp_path / "slo.json"
    path.write_text(json.dumps(spec))
    return AutoscaleConfig(**{"target": 1e9, "min_replicas": 1, "max_replicas": 4,
                              "up_window_s": 5, "down_cooldown_s": 30, "tick_s": 1,
                              "boot_s": 10, "slo_spec": str(path), **kw})


def test_a_class_below_its_goodput_target_orders_a_replica_and_holds_off_scale_down(tmp_path):
    from servelm.autoscale.policy import Autoscaler

    now = [0.0]
    scaler = Autoscaler(_slo_config(tmp_path), clock=lambda: now[0])
    ok = {"interactive": (0.95, 50), "batch": (1.0, 20)}
    miss = {"interactive": (0.80, 50), "batch": (1.0, 20)}  # interactive's target is 90%
    assert scaler.decide(10, 2, 0, ok).reason != "slo:interactive"
    d = scaler.decide(10, 2, 0, miss)
    assert (d.reason, d.delta, d.num_replicas) == ("slo:interactive", 1, 3)
    now[0] = 1.0  # within up_window_s of that event, or with a replica booting: hold
    assert scaler.decide(10, 2, 1, miss).delta == 0
    assert scaler.decide(10, 3, 0, {"interactive": (0.5, 3)}).delta == 0  # 3 < 10 requests
    # The signal alone (far below its target) would scale down after the cool-down; while
    # the class misses it holds.
    now[0] = 100.0
    for t in range(100, 200):
        now[0] = float(t)
        assert scaler.decide(10, 4, 0, {"interactive": (0.85, 50)}).delta == 0
    with pytest.raises(ValueError, match="slo_spec"):
        _slo_config(tmp_path, slo_spec=str(tmp_path / "missing.json"))


def test_the_simulated_fleet_scales_on_the_slo_where_the_signal_never_would(tmp_path):
    """Tokens in flight against a target nobody reaches never scales; the SLO spec's
    interactive class missing its goodput does, and the misses stop."""
    import numpy as np

    from servelm.router.policies import make_policy
    from servelm.sim.autoscale import simulate_autoscaled

    loose = {"classes": [{"name": "interactive", "ttft_ms": 2000, "tpot_ms": 200}]}
    spec = SLOSpec.from_dict(loose)
    rng = np.random.default_rng(0)
    t, reqs = 0.0, []
    while t < 80:
        t += rng.exponential(1 / 30)
        reqs.append(SimRequest(t, [int(x) for x in rng.integers(100, 900, 200)], 40,
                               spec.get("interactive").request_slo()))
    cost = StepCostModel("linear", base_s=0.02, per_decode_token_s=0.001,
                         per_prefill_token_s=0.0002)
    replica = ReplicaSpec(num_blocks=2048, block_size=16, max_num_seqs=32,
                          max_num_batched_tokens=512)
    plain = simulate_autoscaled(reqs, replica, cost, make_policy("least_loaded"),
                                _slo_config(tmp_path, loose, slo_spec=None))
    guarded = simulate_autoscaled(reqs, replica, cost, make_policy("least_loaded"),
                                  _slo_config(tmp_path, loose))
    assert not plain.events
    reasons = [e.reason for e in guarded.events]
    assert reasons and all(r == "slo:interactive" for r in reasons)
    assert guarded.max_replicas > 1
    met = lambda res: sum(spec.get("interactive").met(r.ttft_s, r.tpot_s) for r in res.records
                          if r.is_ok)
    assert len(guarded.records) == len(plain.records) == len(reqs)  # nothing dropped
    assert met(guarded) > 1.5 * met(plain)


def test_cost_scale_stretches_every_step(files):
    spec, cost, tmp = files
    out = {}
    for scale in ("1", "2"):
        path = tmp / f"s{scale}.json"
        assert servelm_main(["sim", "--cost-model", str(cost), "--num-blocks", "512",
                             "--request-rate", "0.5", "--num-prompts", "1", "--input-len", "64",
                             "--output-len", "16", "--cost-scale", scale,
                             "--out", str(path)]) == 0
        out[scale] = json.loads(path.read_text())
    assert out["2"]["tpot_ms"]["p50"] == pytest.approx(2 * out["1"]["tpot_ms"]["p50"])
    assert out["2"]["sim"]["cost_model"] == "cpu-like x2"
    assert servelm_main(["sim", "--cost-model", str(cost), "--num-blocks", "64",
                         "--request-rate", "1", "--cost-scale", "0", "--out",
                         str(tmp / "x.json")]) == 2
