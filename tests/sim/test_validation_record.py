"""`servelm sim validate`: the judgement of simulated against repeated measured runs, the
drift scales, the record's schedule and its time estimate (no server: the command's end to
end run is the record itself, docs/sim.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelm.sim import validation as V
from servelm.engine.step_cost_model import StepCostModel, StepShape
from servelm.engine.step_trace import TimedStep
from servelm.sim.validate_cli import (Progress, ValidationPlan, estimate_total_s, schedule)


def _run(ttft: float, tpot: float, goodput: float = 1.0) -> dict:
    """A serve result whose p50 / p90 / p99 are the value x 1, 2, 3."""
    return {"ttft_ms": {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft},
            "tpot_ms": {"p50": tpot, "p90": 2 * tpot, "p99": 3 * tpot}, "goodput": goodput}


RUNS = [_run(100, 20, 0.9), _run(110, 22, 0.95), _run(90, 18, 0.8), _run(120, 25, 1.0),
        _run(105, 21, 0.85)]


def test_the_spread_is_the_median_and_range_of_the_runs():
    s = V.spread(RUNS)
    assert s["ttft_ms"]["p50"]["median"] == 105
    assert (s["ttft_ms"]["p90"]["min"], s["ttft_ms"]["p90"]["max"]) == (180, 240)
    assert s["goodput"]["median"] == 0.9 and s["num_runs"] == 5


@pytest.mark.parametrize("factor, met", [(1.14, True), (0.86, True), (1.16, False),
                                         (0.84, False)])
def test_below_the_knee_every_percentile_is_within_15_percent_of_the_median(factor, met):
    measured = V.spread(RUNS)
    sim = V.simulated_values([_run(105 * factor, 21 * factor)])
    got = V.compare(measured, sim, "median")
    assert got["met"] is met
    assert got["percentiles"]["ttft_p99"]["error"] == pytest.approx(factor - 1)


def test_at_the_knee_every_percentile_must_lie_inside_the_measured_range():
    measured = V.spread(RUNS)
    inside = V.compare(measured, V.simulated_values([_run(95, 24)]), "range")
    assert inside["met"] and all(r["in_range"] for r in inside["percentiles"].values())
    # TTFT within 15% of the median but below the fastest run: outside the range
    outside = V.compare(measured, V.simulated_values([_run(89, 24)]), "range")
    assert not outside["met"]
    assert [k for k, r in outside["percentiles"].items() if not r["in_range"]] == \
        ["ttft_p50", "ttft_p90", "ttft_p99"]


def test_past_the_knee_goodput_is_within_10_points():
    measured = V.spread(RUNS)  # median goodput 0.9
    assert V.compare(measured, V.simulated_values([_run(500, 50, 0.81)]), "goodput")["met"]
    assert not V.compare(measured, V.simulated_values([_run(100, 20, 0.79)]), "goodput")["met"]


def test_several_simulations_answer_with_their_median():
    sims = [_run(100, 20, 0.5), _run(130, 10, 0.9), _run(400, 30, 0.7)]
    got = V.simulated_values(sims)
    assert got["ttft_ms"]["p90"] == 260 and got["tpot_ms"]["p50"] == 20
    assert got["goodput"] == 0.7


def test_the_bar_needs_every_point_and_the_knee_rate():
    measured = V.spread(RUNS)
    good = {"half": V.compare(measured, V.simulated_values([_run(105, 21)]), "median")}
    assert V.judge(good, V.knee_rate(5.0, 5.4))["met"]
    assert not V.judge(good, V.knee_rate(5.0, 5.6))["met"]  # +12%
    assert not V.judge(good, V.knee_rate(5.0, None))["met"]
    bad = {**good, "knee": V.compare(measured, V.simulated_values([_run(50, 21)]), "range")}
    assert not V.judge(bad, None)["met"]


def test_the_speed_index_is_measured_over_predicted_step_time():
    model = StepCostModel("m", base_s=0.01, per_seq_s=0.001)
    shape = StepShape(4, 4, 400, 0, 0)  # predicted 14 ms
    steps = [TimedStep(float(i), 0.014 * 1.1, shape) for i in range(10)]
    assert V.speed_index(model, steps) == pytest.approx(1.1)
    assert V.speed_index(model, []) is None
    assert [s.t for s in V.in_window(steps, 2.0, 4.0)] == [2.0, 3.0, 4.0]


def test_a_run_is_scaled_by_the_passes_either_side_of_it_in_time():
    passes = [(100.0, 1.0), (200.0, 1.1), (300.0, 1.05)]
    assert V.bracket_scale(150.0, passes) == pytest.approx(1.05)
    assert V.bracket_scale(250.0, passes) == pytest.approx(1.075)
    assert V.bracket_scale(50.0, passes) == 1.0  # before the first: the first's
    assert V.bracket_scale(400.0, passes) == 1.05
    d = V.drift(passes)
    assert d["end_over_start"] == pytest.approx(1.05) and d["max"] == 1.1
    assert d["minutes"] == pytest.approx(200 / 60)


def test_every_measured_round_is_bracketed_by_calibration_passes():
    plan = ValidationPlan(repeats=5)
    servers = schedule(plan, 4.0)
    assert len(servers) == 6 and servers[0][0].kind == "sweep"
    for r, tasks in enumerate(servers):
        kinds = [t.kind for t in tasks if t.kind != "sweep"]
        # the pass before this round's runs, and the next server's pass after them
        assert kinds[:3] == ["calibration"] * 3
        assert kinds[3:] == (["run"] * 4 if r < 5 else [])
    runs = [t for tasks in servers for t in tasks if t.kind == "run"]
    assert sorted({t.rate for t in runs}) == [2.0, 3.2, 4.0, 6.0]
    assert {t.seed for t in runs} == {0}  # the same requests every round
    assert schedule(ValidationPlan(knee=4.0), 4.0)[0][0].kind == "calibration"


def test_the_estimate_grows_with_the_rounds_and_a_lower_knee():
    base = estimate_total_s(ValidationPlan(knee=4.0))
    assert estimate_total_s(ValidationPlan(knee=4.0, repeats=8)) > base
    assert estimate_total_s(ValidationPlan(knee=2.0)) > base
    assert estimate_total_s(ValidationPlan()) > estimate_total_s(ValidationPlan(knee=5.0))


def test_the_time_left_is_scaled_by_how_the_finished_tasks_ran(capsys):
    p = Progress(total_estimate_s=600.0, num_tasks=3)
    p.finished("a", took_s=200.0, est_s=100.0)  # twice its estimate
    assert "about 17 min left" in capsys.readouterr().err  # 2 x 500 s


@pytest.mark.parametrize("flags, names", [(["--repeats", "0"], "--repeats"),
                                          (["--sweep-rates", "4"], "--sweep-rates"),
                                          (["--knee", "-1"], "--knee")])
def test_bad_flags_are_errors_naming_the_flag(flags, names):
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "validate", *flags,
                           "--estimate"], capture_output=True, text=True)
    assert proc.returncode == 2 and names in proc.stderr


def test_sim_without_a_cost_model_still_says_which_flag_is_missing():
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--request-rate", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--cost-model --gpu" in proc.stderr


def test_the_table_and_the_plot_of_a_record(tmp_path):
    measured = V.spread(RUNS)
    points = {"half": V.compare(measured, V.simulated_values([_run(100, 20)]), "median")}
    record = {"points": {"half": {"rate": 2.0, "measured": measured}},
              "variants": {"base": {"points": points, "knee_rate": V.knee_rate(5.0, 5.2),
                                    "bar": V.judge(points, V.knee_rate(5.0, 5.2))}},
              "drift": V.drift([(0.0, 1.0), (600.0, 1.06)]),
              "speed": [{"kind": "calibration", "t": 0.0, "index": 1.0},
                        {"kind": "run", "t": 300.0, "index": 1.03}]}
    text = V.render_markdown(record)
    assert "| half | 2 | median | ttft_p50 | 105 [90, 120] | 100 | -4.8% | yes |" in text
    assert "+6.0% over 10 min" in text
    pytest.importorskip("matplotlib")
    assert V.plot(record, tmp_path / "v.png").stat().st_size > 0


def _sweep(tmp_path, goodputs):
    import json

    rates = [2.0, 3.0, 4.0, 5.0]
    meeting = [r for r, g in zip(rates, goodputs) if g >= 0.9]
    summary = {"rates": rates, "max_rate_meeting_target": max(meeting) if meeting else None,
               "points": [{"goodput": g} for g in goodputs]}
    path = tmp_path / "serve-sweep.json"
    path.write_text(json.dumps({"summary": summary}))
    return path


def test_the_knee_is_the_highest_swept_rate_meeting_the_target(tmp_path):
    from servelm.sim.validate_cli import _measured_knee

    plan = ValidationPlan(sweep_rates=(2, 3, 4, 5))
    assert _measured_knee(_sweep(tmp_path, [1.0, 0.95, 0.7, 0.3]), plan) == 3.0
    # not bracketed by the sweep: the record stops instead of running at a wrong knee
    with pytest.raises(RuntimeError, match="above the highest"):
        _measured_knee(_sweep(tmp_path, [1.0, 1.0, 1.0, 0.95]), plan)
    with pytest.raises(RuntimeError, match="below the lowest"):
        _measured_knee(_sweep(tmp_path, [0.5, 0.3, 0.2, 0.1]), plan)


def test_the_ci_record_replays_the_calibrated_model_unless_only_a_drift_scale_meets_the_bar():
    from servelm.sim.validate_cli import shipped_variant

    def record(*met):
        return {"variants": {v: {"bar": {"met": m}}
                             for v, m in zip(("base", "bracket", "in_run"), met)}}

    assert shipped_variant(record(True, True, True)) == "base"
    assert shipped_variant(record(False, False, True)) == "in_run"
    assert shipped_variant(record(False, True, True)) == "bracket"
    assert shipped_variant(record(False, False, False)) == "base"
