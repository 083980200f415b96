"""`servelm bench batch-knee`: the record's arithmetic, its flags, and a tiny run end to end
(one server with the default model, seconds-scale sizes) whose record has every field."""

import argparse
import json
import subprocess
import sys

import pytest

from servelm.bench import batch_knee
from servelm.bench.batch_knee import BatchKneePlan, estimate_s, idle_capacity, sustained_knee


def test_the_estimate_has_a_phase_each_and_the_sweep_only_without_a_knee():
    swept = estimate_s(BatchKneePlan())
    given = estimate_s(BatchKneePlan(knee=4.5))
    assert set(swept) == {"server", "sweep", "confirm", "interactive", "with_batch",
                          "batch_alone"}
    assert "sweep" not in given
    assert "confirm" not in estimate_s(BatchKneePlan(knee=4.5, confirm_trials=0))
    # a bigger batch takes longer beside the same traffic, and alone
    bigger = estimate_s(BatchKneePlan(knee=4.5, batch_lines=4000))
    assert bigger["with_batch"] > given["with_batch"]
    assert bigger["batch_alone"] > given["batch_alone"]
    assert "batch_alone" not in estimate_s(BatchKneePlan(knee=4.5, idle_run=False))


def test_the_idle_capacity_expectation():
    alone = {"num_lines": 100, "completion_s": 50.0, "num_output_tokens": 10_000}  # 2 lines/s
    interactive = {"output_tok_s": 150.0}  # of 200 tok/s: a quarter left idle
    # 100 lines beside 400 s of traffic at 0.5 lines/s: done within it, in 200 s
    within = idle_capacity({"num_lines": 100, "completion_s": 250.0}, alone, interactive, 400.0)
    assert within["idle_share"] == pytest.approx(0.25)
    assert within["expected_s"] == pytest.approx(200.0)
    assert within["efficiency"] == pytest.approx(0.8)
    # beside 100 s of traffic: 50 lines then, 50 more at 2 lines/s after it
    after = idle_capacity({"num_lines": 100, "completion_s": 125.0}, alone, interactive, 100.0)
    assert after["expected_s"] == pytest.approx(125.0) and after["efficiency"] == 1.0
    assert idle_capacity({"num_lines": 100, "completion_s": 1.0}, None, interactive, 1.0) is None


def _server(limit: float):
    """A server that sustains rates up to `limit` (a long run's goodput met below it)."""
    return lambda rate: rate <= limit


def test_a_knee_that_is_sustained_is_confirmed_by_one_run():
    sustains = _server(3.5)
    assert sustained_knee(3.0, sustains, 4, 0.1) == (3.0, [(3.0, True)])


def test_a_knee_that_is_not_sustained_is_bisected_down():
    # The sweep said 3 req/s; the server holds 1.7 for the long run: 3 misses, 1.5 meets,
    # 2.25 misses, 1.88 misses: the highest met, 1.5, within the four runs.
    sustains = _server(1.7)
    knee, trials = sustained_knee(3.0, sustains, 4, 0.1)
    assert trials == [(3.0, False), (1.5, True), (2.25, False), (1.88, False)]
    assert knee == 1.5 and knee <= 1.7
    # more runs close in on it: never above what the server holds, within the tolerance
    knee, trials = sustained_knee(3.0, _server(1.7), 10, 0.05)
    assert knee <= 1.7 and min(r for r, met in trials if not met) - knee <= 0.05 * 1.8
    assert len(trials) < 10  # it stopped at the tolerance, not the run limit


def test_no_sustained_rate_within_the_trials_is_none():
    sustains = _server(0.1)
    assert sustained_knee(3.0, sustains, 3, 0.1) == (None, [(3.0, False), (1.5, False),
                                                            (0.75, False)])
    assert sustained_knee(3.0, sustains, 0, 0.1) == (None, [])


def test_the_confirmation_runs_are_kept_and_the_met_one_is_the_interactive_run(
        tmp_path, monkeypatch):
    def client(plan, url, rate, out, log):  # a long run's result: goodput by rate
        out.write_text(json.dumps({"goodput": 0.95 if rate <= 1.7 else 0.4, "rate": rate}))
        return None

    monkeypatch.setattr(batch_knee, "interactive", client)
    monkeypatch.setattr(batch_knee, "_wait", lambda proc, what: None)
    plan = BatchKneePlan(knee=3.0, confirm_trials=4)
    progress = batch_knee.Progress(estimate_s(plan))
    knee, runs = batch_knee._confirm(plan, "http://x", 3.0, tmp_path, progress)
    assert knee == 1.5 and [(r["rate"], r["met"]) for r in runs] == [
        (3.0, False), (1.5, True), (2.25, False), (1.88, False)]
    assert json.loads((tmp_path / "interactive.json").read_text())["rate"] == 1.5
    assert {p.name for p in tmp_path.glob("confirm-*.json")} == {
        "confirm-3.json", "confirm-1.5.json", "confirm-2.25.json", "confirm-1.88.json"}
    monkeypatch.setattr(batch_knee, "interactive", lambda plan, url, rate, out, log:
                        out.write_text(json.dumps({"goodput": 0.1})))
    with pytest.raises(RuntimeError, match="no rate met --goodput-target 0.9 over 300 s in "
                       "2 run.s. down to 1.5 req/s: give a lower --knee"):
        batch_knee._confirm(BatchKneePlan(knee=3.0, confirm_trials=2), "http://x", 3.0,
                            tmp_path, progress)


@pytest.mark.parametrize("flags, names", [
    (["--knee", "0"], "--knee"), (["--batch-lines", "0"], "--batch-lines"),
    (["--duration", "-1"], "--duration"), (["--output-len", "x"], "--output-len"),
    (["--sweep-rates", "3"], "--sweep-rates"), (["--confirm-trials", "-1"], "--confirm-trials"),
    (["--confirm-tol", "1"], "--confirm-tol")])
def test_bad_flags_are_errors_naming_the_flag(flags, names):
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "bench", "batch-knee", *flags,
                           "--estimate"], capture_output=True, text=True)
    assert proc.returncode == 2 and names in proc.stderr, proc.stderr


def test_a_tiny_record_end_to_end(default_model_path, tmp_path, capsys):
    from servelm.bench.batch_knee import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    out = tmp_path / "record"
    args = parser.parse_args([
        "batch-knee", "--model", str(default_model_path), "--knee", "2", "--duration", "3",
        "--batch-lines", "6", "--input-len", "8:16", "--output-len", "4", "--poll", "0.2",
        "--max-num-seqs", "8", "--confirm-trials", "0", "--serve-arg=--cpu-kernels=torch",
        "--serve-arg=--kv-cache-memory=64MiB", "--out", str(out)])
    assert args.func(args) == 0
    rec = json.loads((out / "batch-knee.json").read_text())
    assert rec["kind"] == "batch_knee" and rec["commit"] and rec["machine"]["cpu"]
    assert rec["command"].startswith("servelm bench") and "--scheduling-policy slo" in \
        rec["server_command"]
    assert rec["knee_req_s"] == 2 and rec["knee_source"] == "given"
    it = rec["interactive"]
    for run in (it["without_batch"], it["with_batch"]):
        assert run["num_completed"] > 0 and 0 <= run["goodput"] <= 1
    assert it["goodput_drop_points"] == pytest.approx(
        100 * (it["without_batch"]["goodput"] - it["with_batch"]["goodput"]))
    assert it["met"] == (it["goodput_drop_points"] <= 5.0)
    for run in (rec["batch"]["with_interactive"], rec["batch"]["alone"]):
        assert run["status"] == "completed" and run["num_completed"] == 6
        assert run["completion_s"] > 0 and run["progress"][-1][1] == 6
    assert rec["batch"]["with_interactive"]["interactive_s"] > 0
    assert rec["batch"]["idle_capacity"]["expected_s"] > 0
    assert (out / "batch-knee.png").stat().st_size > 10_000
    md = (out / "batch-knee.md").read_text()
    assert "goodput drop" in md and rec["commit"] in md
    assert "[batch-knee]" in capsys.readouterr().err
