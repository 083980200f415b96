"""benchmarks/cpu/family_stack.py --rounds: each cell is the median over the rounds, in the
families' order whatever order a round ran them in."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu" / "family_stack.py"


def _module():
    spec = importlib.util.spec_from_file_location("family_stack", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(family, step_s, batch=1):
    return {"family": family, "dtype": "float32", "path": "stack", "batch": batch,
            "median_step_s": step_s, "decode_tok_s": batch / step_s,
            "weight_bytes_per_step": 1e9, "weight_bytes_per_s": 1e9 / step_s}


def test_cells_are_the_rounds_medians_in_family_order():
    fs = _module()
    rounds = [[_row("llama", 0.010), _row("qwen3", 0.040)],
              [_row("qwen3", 0.020), _row("llama", 0.030)],   # rotated order
              [_row("llama", 0.020), _row("qwen3", 0.030)]]
    rows = fs.merge_rounds(rounds, ["llama", "qwen3"])
    assert [r["family"] for r in rows] == ["llama", "qwen3"]
    llama, qwen3 = rows
    assert llama["median_step_s"] == 0.020 and qwen3["median_step_s"] == 0.030
    assert llama["decode_tok_s"] == 1 / 0.020
    assert qwen3["weight_bytes_per_s"] == 1e9 / 0.030
    assert llama["rounds_tok_s"] == [100.0, 33.3, 50.0]
    fs.add_ratios(rows)
    assert abs(qwen3["per_byte_vs_llama"] - 0.020 / 0.030) < 1e-12
