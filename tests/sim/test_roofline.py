"""The roofline step-cost model is the planner's arithmetic: a decode step is `plan
decode`'s step time, a lone prompt `plan prefill`'s time; `servelm sim --gpu` runs on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servelm.cost import attention_pairs
from servelm.planner.calibration import Calibration
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.hardware import get_accelerator
from servelm.planner.model_catalog import resolve_model
from servelm.planner.prefill import prefill_time
from servelm.engine.step_cost_model import StepShape
from servelm.sim.roofline import RooflineCostModel


@pytest.fixture(scope="module")
def d70b() -> Deployment:
    return Deployment(resolve_model("Llama-3.1-70B"), get_accelerator("H100-SXM"), tp=8,
                      calibration=Calibration(bandwidth_fraction=0.8, decode_mfu=0.7,
                                              prefill_mfu=0.5, step_overhead_s=0.002))


@pytest.mark.parametrize("batch, context", [(1, 100), (64, 2150), (555, 2150), (2000, 500)])
def test_a_decode_step_is_plan_decodes_step_time(d70b, batch, context):
    cost = RooflineCostModel(d70b)
    shape = StepShape(batch, batch, batch * (context + 1), 0, 0)
    assert cost.predict(shape) == pytest.approx(step_time(d70b, batch, context).step_s,
                                                rel=1e-9)


@pytest.mark.parametrize("tokens", [200, 2000, 8000])
def test_a_lone_prompt_is_plan_prefills_time(d70b, tokens):
    cost = RooflineCostModel(d70b)
    shape = StepShape(1, 0, 0, tokens, attention_pairs(0, tokens))
    planned = prefill_time(d70b, tokens, d70b.calibration.prefill_mfu).time_s
    # A simulated step pays the step overhead (plan prefill has none) and the KV writes;
    # the planner's memory floor reads the embedding table too: within 1% here.
    assert cost.predict(shape) == pytest.approx(planned + d70b.calibration.step_overhead_s,
                                                rel=0.01)


def test_a_mixed_step_overlaps_decode_memory_with_prefill_compute(d70b):
    cost = RooflineCostModel(d70b)
    decode = StepShape(200, 200, 200 * 2151, 0, 0)
    chunk = StepShape(1, 0, 0, 800, attention_pairs(0, 800))
    mixed = StepShape(201, 200, 200 * 2151, 800, attention_pairs(0, 800))
    t_dec, t_pre, t_mix = (cost.predict(s) for s in (decode, chunk, mixed))
    assert max(t_dec, t_pre) <= t_mix < t_dec + t_pre


def test_sim_runs_on_the_roofline_and_sizes_the_kv_pool_from_the_gpu(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--gpu", "H100-SXM",
                           "--model", "Llama-3.1-70B", "--tp", "8", "--request-rate", "4",
                           "--num-prompts", "12", "--input-len", "500:1500", "--output-len",
                           "20:60", "--max-num-seqs", "256", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["num_completed"] == 12
    assert doc["sim"]["cost_model"] == "roofline-Llama-3.1-70B-H100-SXM-tp8"
    # One 70B decode step on 8 x H100 reads ~141 GB of bf16 weights over 8 x 3.35 TB/s.
    assert 4.0 < doc["tpot_ms"]["p50"] < 15.0


@pytest.mark.parametrize("flags, named", [
    (["--gpu", "no-such-gpu"], "--gpu"),
    (["--gpu", "H100-SXM", "--tp", "0"], "--tp"),
    (["--gpu", "H100-SXM", "--prefill-mfu", "1.5"], "prefill_mfu"),
])
def test_bad_roofline_flags_exit_2_naming_the_flag(tmp_path, flags, named):
    proc = subprocess.run([sys.executable, "-m", "servelm.cli", "sim", "--model",
                           "Llama-3.1-70B", *flags, "--request-rate", "1", "--out",
                           str(tmp_path / "o.json")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def _step_cost_reference(cost: RooflineCostModel, shape: StepShape) -> float:
    """The module doc's formula written with servelm.cost.step_cost, as plan does."""
    from servelm.cost import step_cost, weight_bytes_read_per_step

    d = cost.deployment
    m, bpp, kv = d.model, d.bytes_per_param, d.kv_bytes_per_token
    dec = step_cost(m, bpp, kv, shape.num_decode_tokens, shape.num_decode_context_tokens,
                    shape.num_decode_context_tokens)
    pre = step_cost(m, bpp, kv, shape.num_prefill_tokens, 0, shape.num_prefill_pairs)
    weights = weight_bytes_read_per_step(m, shape.num_decode_tokens + shape.num_prefill_tokens,
                                         bpp) + (d.attention_copies - 1) * d.attention_weight_bytes
    memory_s = (weights + (dec.kv_bytes + pre.kv_bytes) * d.kv_copies) / cost._bw
    compute_s = dec.flops / cost._decode_flops + pre.flops / cost._prefill_flops
    return max(memory_s, compute_s) + d.calibration.step_overhead_s


@pytest.mark.parametrize("model, gpu, tp", [("Llama-3.1-70B", "H100-SXM", 8),
                                            ("Mixtral-8x7B", "H100-SXM", 2)])
def test_predict_is_step_costs_arithmetic_exactly(model, gpu, tp):
    """predict() keeps step_cost's per-model factors (it runs for every simulated step):
    the same float result as the formula over step_cost, for decode, prefill and mixed."""
    try:
        m = resolve_model(model)
    except ValueError:
        pytest.skip(f"{model} is not in the catalog")
    cost = RooflineCostModel(Deployment(m, get_accelerator(gpu), tp=tp))
    shapes = [StepShape(1, 1, 101, 0, 0), StepShape(555, 555, 555 * 2151, 0, 0),
              StepShape(1, 0, 0, 1369, attention_pairs(0, 1369)),
              StepShape(130, 129, 129 * 900, 1240, attention_pairs(760, 1240)),
              StepShape(7, 3, 3 * 40, 8, attention_pairs(0, 4) + attention_pairs(10, 4))]
    for shape in shapes + shapes:  # twice: the second time from the weight-bytes memo
        assert cost.predict(shape) == _step_cost_reference(cost, shape)
