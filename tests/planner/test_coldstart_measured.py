"""`servelm plan coldstart --measured`: a `servelm bench coldstart` record's stages laid next
to the planned ones, every measured second accounted for exactly once."""

import json

import pytest

from servelm.planner.cli import main
from servelm.startup import STAGES

_STAGES = {"frontend_start": 0.5, "interpreter": 0.05, "imports": 1.2, "config": 0.05,
           "tokenizer": 0.15, "kernels": 0.08, "weights_read": 0.04, "weights_pack": 0.6,
           "kv_alloc": 0.001, "warmup": 0.2, "engine_other": 0.1, "core_spawn": 0.01,
           "frontend_ready": 0.12}


def _record(tmp_path, **extra):
    rec = {"kind": "coldstart", "warm_median": {"stages_s": _STAGES,
                                                "ready_s": sum(_STAGES.values())}, **extra}
    path = tmp_path / "coldstart.json"
    path.write_text(json.dumps(rec))
    return path


def _plan(capsys, *flags):
    assert main(["plan", "coldstart", "--model", "SmolLM2-135M", "--weight-dtype", "fp32",
                 "--tier", "dram", "--dram-bw", "10", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_measured_stage_lands_in_one_row(tmp_path, capsys):
    from servelm.planner.coldstart import MEASURED_STAGES

    out = _plan(capsys, "--measured", str(_record(tmp_path)))
    rows = {r["stage"]: r for r in out["stages"]}
    mapped = [n for names in MEASURED_STAGES.values() for n in names]
    assert len(mapped) == len(set(mapped)) and set(mapped) <= set(STAGES)
    assert rows["storage_read_s"]["measured_s"] == pytest.approx(0.04)
    assert rows["warmup_s"]["measured_s"] == pytest.approx(0.2)
    assert rows["runtime_init_s"]["measured_s"] == pytest.approx(
        sum(v for k, v in _STAGES.items() if k not in ("weights_read", "weights_pack",
                                                       "warmup")), abs=1e-3)
    assert rows["weights_pack"] == {"stage": "weights_pack", "planned_s": "-",
                                    "measured_s": 0.6, "measured_as": "not in the plan"}
    assert rows["host_to_gpu_s"]["measured_s"] == "-"  # no GPU in the record
    measured = sum(r["measured_s"] for k, r in rows.items()
                   if k != "total_s" and r["measured_s"] != "-")
    assert measured == pytest.approx(rows["total_s"]["measured_s"], abs=2e-3)
    # the planned column is the plan's own: 540 MB of fp32 weights at 10 GB/s
    assert rows["storage_read_s"]["planned_s"] == pytest.approx(out["storage_read_s"], abs=1e-3)
    assert out["storage_read_s"] == pytest.approx(134_515_008 * 4 / 10e9, rel=1e-3)
    assert out["measured_unplanned_s"] == pytest.approx(0.6)


def test_without_measured_the_tiers_table_stays(capsys):
    out = _plan(capsys)
    assert "tiers" in out and "stages" not in out


def test_a_record_of_another_kind_is_refused(tmp_path, capsys):
    bad = _record(tmp_path, kind="offline")
    assert main(["plan", "coldstart", "--model", "SmolLM2-135M", "--measured", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--measured: not a `servelm bench coldstart` record" in err
    assert main(["plan", "coldstart", "--model", "SmolLM2-135M", "--measured",
                 str(tmp_path / "missing.json")]) == 2
    assert "--measured: cannot read" in capsys.readouterr().err
