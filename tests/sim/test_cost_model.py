"""StepCostModel's two forms: what each predicts, the roofline fit, and the file format
(a file written before the form existed still loads, as the linear form)."""

from __future__ import annotations

import json
import random

import pytest

from servelm.engine.step_cost_model import (STEP_CLASSES, StepCostModel, StepShape, fit_cost_model,
                                    step_class, step_class_errors)

ROOF = StepCostModel("roof", form="roofline", base_s=0.03, per_seq_s=1.5e-4,
                     per_decode_token_s=1e-4, per_decode_context_s=3.5e-6,
                     per_prefill_token_s=2.7e-4, per_prefill_pair_s=2.4e-7,
                     prefill_step_s=0.037)


def test_the_roofline_form_takes_the_larger_of_memory_and_compute():
    m = ROOF
    decode = StepShape(20, 20, 6000, 0, 0)
    memory = 20 * 1.5e-4 + 20 * 1e-4 + 6000 * 3.5e-6
    assert m.predict(decode) == pytest.approx(0.03 + memory)
    # A 2,000-token chunk beside the same decodes: compute-bound, the decodes' reads hidden
    # and their rows costing a token's compute each.
    mixed = StepShape(23, 20, 6000, 2000, 350_000)
    compute = 0.037 + 2.7e-4 * 2020 + 2.4e-7 * 350_000
    assert m.predict(mixed) == pytest.approx(0.03 + compute)
    alone = StepShape(3, 0, 0, 2000, 350_000)
    assert m.predict(mixed) - m.predict(alone) == pytest.approx(20 * 2.7e-4)
    # A short chunk beside many long decodes: memory-bound, the chunk adds nothing.
    heavy = StepShape(65, 64, 200_000, 16, 136)
    assert m.predict(heavy) == pytest.approx(m.predict(StepShape(65, 64, 200_000, 0, 0)))
    assert m.step_time(*mixed) == m.predict(mixed)
    # The linear form sums the same parts.
    lin = StepCostModel("lin", base_s=0.03, per_seq_s=1.5e-4, per_decode_token_s=1e-4,
                        per_decode_context_s=3.5e-6, per_prefill_token_s=2.7e-4,
                        per_prefill_pair_s=2.4e-7)
    assert lin.predict(mixed) == pytest.approx(
        0.03 + 23 * 1.5e-4 + memory - 20 * 1.5e-4 + 2.7e-4 * 2000 + 2.4e-7 * 350_000)


def test_the_roofline_fit_recovers_known_coefficients_and_reports_by_class():
    rng = random.Random(3)
    shapes = [StepShape(n, n, n * rng.randint(50, 600), 0, 0) for n in range(1, 65)
              for _ in range(4)]
    for _ in range(120):  # chunks of 16-2,048 tokens, alone or beside 1-48 decodes
        k, d, p = rng.randint(1, 6), rng.choice([0, rng.randint(1, 48)]), rng.randint(16, 2048)
        shapes.append(StepShape(k + d, d, d * rng.randint(50, 600), p,
                                p * p // 2 // k))
    seconds = [ROOF.predict(s) for s in shapes]
    fit = fit_cost_model("fit", shapes, seconds, form="roofline")
    assert fit.form == "roofline"
    assert fit.fit["mean_abs_rel_error"] < 1e-6
    for name in ("base_s", "per_decode_context_s", "per_prefill_token_s",
                 "per_prefill_pair_s", "prefill_step_s"):
        assert getattr(fit, name) == pytest.approx(getattr(ROOF, name), rel=1e-4)
    # seqs == decode tokens in a decode-only step: only their sum is identified there
    assert fit.per_seq_s + fit.per_decode_token_s == pytest.approx(2.5e-4, rel=1e-4)
    assert set(fit.fit["by_class"]) == set(STEP_CLASSES)
    for row in fit.fit["by_class"].values():
        assert abs(row["error_p50"]) < 1e-6 and row["total_ratio"] == pytest.approx(1.0)
    # The linear form cannot follow it: its error shows in the report, class by class.
    lin = fit_cost_model("lin", shapes, seconds)
    assert lin.form == "linear" and lin.fit["mean_abs_rel_error"] > 0.01
    assert lin.fit["by_class"]["prefill beside decodes"]["mean_abs_error"] > 0.01


def test_step_classes_and_their_errors():
    assert step_class(StepShape(4, 4, 100, 0, 0)) == "decode only"
    assert step_class(StepShape(1, 0, 0, 300, 45150)) == "prefill only"
    assert step_class(StepShape(5, 4, 100, 300, 45150)) == "prefill beside decodes"
    half = StepCostModel("half", base_s=0.01)
    rows = step_class_errors(half, [StepShape(1, 1, 1, 0, 0), StepShape(1, 1, 1, 0, 0),
                                    StepShape(1, 0, 0, 9, 45)], [0.02, 0.01, 0.005])
    assert list(rows) == ["decode only", "prefill only"]
    assert rows["decode only"]["n"] == 2
    assert rows["decode only"]["error_p50"] == pytest.approx((-0.5 + 0.0) / 2)
    assert rows["decode only"]["total_ratio"] == pytest.approx(0.02 / 0.03)
    assert rows["prefill only"]["error_p50"] == pytest.approx(1.0)


def test_files_round_trip_and_a_version_1_file_loads_as_linear(tmp_path):
    path = tmp_path / "roof.json"
    ROOF.save(path)
    data = json.loads(path.read_text())
    assert data["kind"] == "step-cost-model" and data["version"] == 2
    assert data["form"] == "roofline" and "_is_roofline" not in data
    back = StepCostModel.load(path)
    assert back == ROOF
    shape = StepShape(23, 20, 6000, 2000, 350_000)
    assert back.predict(shape) == ROOF.predict(shape)
    # Written before the form existed: no version, no form, no prefill_step_s.
    old = {"kind": "step-cost-model", "name": "old", "base_s": 0.03, "per_seq_s": 3e-4,
           "per_decode_token_s": 0.0, "per_decode_context_s": 3.4e-6,
           "per_prefill_token_s": 3.8e-4, "per_prefill_pair_s": 0.0, "arrival_s": 0.0015,
           "fit": {"num_samples": 1}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    m = StepCostModel.load(tmp_path / "old.json")
    assert m.form == "linear" and m.arrival_s == 0.0015
    assert m.predict(shape) == pytest.approx(0.03 + 23 * 3e-4 + 6000 * 3.4e-6 + 2000 * 3.8e-4)


def test_bad_forms_and_versions_are_errors(tmp_path):
    with pytest.raises(ValueError, match="form"):
        StepCostModel("x", form="cubic")
    with pytest.raises(ValueError, match="prefill_step_s"):
        StepCostModel("x", prefill_step_s=0.01)
    with pytest.raises(ValueError, match="form"):
        fit_cost_model("x", [StepShape(1, 1, 1, 0, 0)] * 10, [0.01] * 10, form="cubic")
    with pytest.raises(ValueError, match="at least 7"):
        fit_cost_model("x", [StepShape(1, 1, 1, 0, 0)] * 6, [0.01] * 6, form="roofline")
    (tmp_path / "new.json").write_text(json.dumps({"kind": "step-cost-model", "version": 3,
                                                   "name": "x"}))
    with pytest.raises(ValueError, match="version 3"):
        StepCostModel.load(tmp_path / "new.json")


@pytest.mark.parametrize("form", ["linear", "roofline"])
def test_the_fit_predicts_the_mean_step_time_under_skewed_noise(form):
    """Step times with a right-skewed spread around the model (a few slow steps, as a
    served CPU's are): the fit's predicted total is the measured total (the simulator sums
    step times), where weights from the measurement alone come out a few per cent low."""
    import numpy as np

    from servelm.engine import step_cost_model as cost_model

    rng = np.random.default_rng(3)
    shapes, seconds = [], []
    for _ in range(3000):
        n = int(rng.integers(1, 64))
        chunk = int(rng.integers(0, 512)) if rng.random() < 0.2 else 0
        shape = StepShape(n + (chunk > 0), n, n * int(rng.integers(100, 600)), chunk,
                          chunk * chunk // 2)
        shapes.append(shape)
        seconds.append(ROOF.predict(shape) * float(rng.lognormal(0.0, 0.35)))
    measured = sum(seconds)
    fitted = fit_cost_model("skewed", shapes, seconds, form)
    assert fitted.fit["total_s_predicted"] / measured == pytest.approx(1.0, abs=0.02)
    once = cost_model._REWEIGHT_ROUNDS
    try:  # weights from the measurement only: low
        cost_model._REWEIGHT_ROUNDS = 0
        plain = fit_cost_model("skewed", shapes, seconds, form)
    finally:
        cost_model._REWEIGHT_ROUNDS = once
    assert plain.fit["total_s_predicted"] / measured < 0.95
