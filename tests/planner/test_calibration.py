import json

import pytest

from servelm.planner.calibration import Calibration, load_calibration
from servelm.planner.errors import PlanInputError


def test_defaults_are_assumptions():
    c = load_calibration(None)
    assert c == Calibration() and c.is_assumed
    assert (c.bandwidth_fraction, c.decode_mfu, c.step_overhead_s) == (1.0, 1.0, 0.0)


def test_load_from_json(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"bandwidth_fraction": 0.8, "prefill_mfu": 0.45,
                             "step_overhead_s": 0.002}))
    c = load_calibration(f)
    assert (c.bandwidth_fraction, c.prefill_mfu, c.step_overhead_s) == (0.8, 0.45, 0.002)
    assert c.source == str(f) and not c.is_assumed


@pytest.mark.parametrize("body", ['{"bandwith_fraction": 0.8}', '{"prefill_mfu": 2}', "[1]",
                                  "{oops"])
def test_bad_files_name_the_flag(tmp_path, body):
    f = tmp_path / "cal.json"
    f.write_text(body)
    with pytest.raises(PlanInputError) as e:
        load_calibration(f)
    assert "calibration" in e.value.param
