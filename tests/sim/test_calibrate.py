"""`servelm bench calibrate --served-steps`: the form chosen is the form fitted and saved,
and the fit's error by step class is in the file."""

from __future__ import annotations

import json
import random

import pytest

from servelm.bench.calibrate import calibrate_served
from servelm.cli import main
from servelm.engine.step_cost_model import StepCostModel, StepShape

TRUTH = StepCostModel("truth", form="roofline", base_s=0.03, per_seq_s=1.5e-4,
                      per_decode_token_s=1.5e-4, per_decode_context_s=3.5e-6,
                      per_prefill_token_s=2.7e-4, per_prefill_pair_s=2.4e-7,
                      prefill_step_s=0.037)


def _served_trace(path, seed: int) -> None:
    """A step trace whose steps take what TRUTH says (8 warm-up steps first, dropped)."""
    rng = random.Random(seed)
    shapes = [StepShape(1, 1, 10, 0, 0)] * 8
    shapes += [StepShape(n, n, n * rng.randint(50, 500), 0, 0) for n in range(1, 49)]
    for _ in range(60):
        k, d, p = rng.randint(1, 5), rng.randint(0, 40), rng.randint(100, 2040)
        shapes.append(StepShape(k + d, d, d * rng.randint(50, 500), p, p * p // 2 // k))
    lines = [{"kind": "step-trace", "engine": {"num_blocks": 100, "block_size": 16}}]
    lines += [{"t": i, "s": 5.0 if i < 8 else TRUTH.predict(s), "shape": list(s)}
              for i, s in enumerate(shapes)]
    lines += [{"admit_s": 0.002, "idle": True}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_calibrate_served_fits_the_roofline_form_behind_the_steps(tmp_path):
    _served_trace(tmp_path / "a.jsonl", 1)
    _served_trace(tmp_path / "b.jsonl", 2)
    paths = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    model = calibrate_served(paths, "m", form="roofline")
    assert model.form == "roofline" and model.fit["num_samples"] == 2 * 108
    assert model.fit["mean_abs_rel_error"] < 1e-6
    assert model.prefill_step_s == pytest.approx(TRUTH.prefill_step_s, rel=1e-4)
    assert model.per_prefill_token_s == pytest.approx(TRUTH.per_prefill_token_s, rel=1e-4)
    assert model.arrival_s == pytest.approx(0.002)
    # The linear form fitted to the same steps misses the mixed ones, and says so.
    linear = calibrate_served(paths, "m")
    assert linear.form == "linear"
    assert linear.fit["by_class"]["prefill beside decodes"]["mean_abs_error"] > 0.02


@pytest.mark.parametrize("form", ["roofline", "linear"])
def test_the_calibrate_command_writes_the_form_asked_for(tmp_path, capsys, form):
    _served_trace(tmp_path / "a.jsonl", 1)
    out = tmp_path / "model.json"
    args = ["bench", "calibrate", "--served-steps", str(tmp_path / "a.jsonl"),
            "--out", str(out)]
    assert main(args + (["--form", form] if form == "linear" else [])) == 0
    saved = json.loads(out.read_text())
    assert saved["form"] == form and saved["version"] == 2
    assert set(saved["fit"]["by_class"]) == {"decode only", "prefill only",
                                             "prefill beside decodes"}
    assert StepCostModel.load(out).form == form
    err = capsys.readouterr().err
    assert f"{form} form" in err and "prefill beside decodes:" in err
