"""CPU checks of the H200 benchmark: roofline arithmetic by hand, argument parsing, and a tiny
dry run of a phase and the report. Not under tests/ (CI does not run benchmarks); run with
    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q benchmarks/gpu/test_h200_bench.py
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_bench
import roofline

from servelm import cost
from servelm.loader.dummy import dummy_model_config


def _tiny():
    return h200_bench.model_config("dummy:llama-3.1-8b", tiny=True)


def test_costs_by_hand():
    c = _tiny()  # L=2, hidden 64, I=128, H=4, K=2, D=16, vocab 512
    b = cost.count_params(c)  # one layer: attention + 2 norms + MLP
    assert b.attention_per_layer + b.norms_per_layer + b.dense_mlp_per_layer == \
        64 * (2 * 64 + 2 * 32) + 2 * 64 + 3 * 64 * 128
    costs = roofline.model_costs(c, dtype_bytes=4)
    assert costs.weight_bytes == (2 * 36992 + 512 * 64 + 64) * 4
    assert costs.attn_flops_per_pair == 4 * 2 * 4 * 16
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    decode = roofline.step_cost(costs, [(10, 1, True)])  # sees 11 keys
    assert decode.flops == 2 * 2 * 36992 + 11 * 512 + 2 * 512 * 64
    assert decode.kv_bytes == (10 + 2) * 512
    prefill = roofline.step_cost(costs, [(0, 4, False)])  # causal: 1 + 2 + 3 + 4 pairs
    assert prefill.flops == 4 * 2 * 2 * 36992 + 10 * 512
    assert roofline.ideal_seconds(decode, bandwidth=1e9, flops_rate=1e30) == decode.bytes / 1e9


def test_full_size_parameter_counts():
    assert roofline.num_params(dummy_model_config("llama-3.1-8b")) == 8_030_261_248
    assert roofline.num_params(dummy_model_config("qwen3-0.6b")) == 596_049_920


def test_summarize_and_workload_bound():
    costs = roofline.model_costs(_tiny(), 4)
    steps = [([(0, 4, True)], 0.5), ([(4, 1, True)], 0.25)]
    s = roofline.summarize(steps, costs, bandwidth=1e6, flops_rate=1e12, elapsed_s=1.0)
    assert s["steps"] == 2 and s["step_s"] == 0.75
    assert s["roofline_share"] == pytest.approx(s["ideal_s"])
    bound = roofline.workload_bound(costs, [(4, 2)], bandwidth=1e6, flops_rate=1e12)
    assert bound["flops"] == sum(roofline.step_cost(costs, [sp]).flops for sp in steps[0][0] +
                                 steps[1][0])
    assert bound["weight_bytes"] == 2 * costs.weight_bytes


def test_workload_is_seeded_and_in_range():
    a = h200_bench.uniform_workload(256, 100, 1024, 128256, 0)
    assert a == h200_bench.uniform_workload(256, 100, 1024, 128256, 0)
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 for p, n in a)
    assert all(100 <= t < 128156 for p, _ in a for t in p)


def test_cpu_without_tiny_is_refused():
    with pytest.raises(SystemExit):
        h200_bench.main(["decode", "--device", "cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run interprets Triton on the CPU")
def test_decode_dry_run_and_report(tmp_path, capsys):
    out = tmp_path / "decode.json"
    h200_bench.main(["decode", "--device", "cpu", "--tiny", "--dtype", "float32",
                     "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["num_output_tokens"] == 8 and r["decode_steps"] == 7
    assert 0 < r["bandwidth_utilisation"] and r["setup"]["graph_capture_s"] is not None
    h200_bench.main(["report", "--inputs", str(out), str(tmp_path / "missing.json")])
    assert "tok/s decode" in capsys.readouterr().out
