import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.planner.calibration import Calibration
from servelm.planner.decode import plan_decode, step_time


def test_batch_one_is_weights_over_bandwidth(deploy):
    # Llama-3.1-8B bf16 on H100: ~15.0 GB of matmul weights / 3.35 TB/s ~ 4.5 ms per token,
    # the classic "bytes over bandwidth" bound (~220 tok/s per stream).
    p = plan_decode(deploy(tp=1), batch=1, context=1)
    assert p.bound == "memory"
    assert p.step_time_s == pytest.approx(15.01e9 / 3.35e12, rel=0.01)
    assert p.tokens_per_s_per_user == pytest.approx(1 / p.step_time_s)


def test_ridge_near_hardware_ridge_for_short_context(deploy):
    # bf16: 2 bytes and 2 FLOPs per weight, so without KV the ridge batch equals the GPU's
    # FLOP/byte ratio (~295 on H100).
    p = plan_decode(deploy(tp=1), batch=1, context=1)
    assert p.ridge_batch == pytest.approx(295, rel=0.03)
    d, b = deploy(tp=1), int(p.ridge_batch)
    at, below = step_time(d, b, 1), step_time(d, b - 1, 1)
    assert at.compute_s >= at.memory_s and below.compute_s < below.memory_s


def test_long_context_never_reaches_ridge(deploy):
    # Per sequence at 8k context: ~15 GFLOP over 8192 x 128 KiB of KV = ~14 FLOP/B << 295.
    p = plan_decode(deploy(tp=1), batch=8, context=8192)
    assert math.isinf(p.ridge_batch)


def test_fp8_weights_halve_the_memory_bound(deploy):
    bf16 = plan_decode(deploy(tp=1), batch=1, context=1)
    fp8 = plan_decode(deploy(tp=1, weight_dtype="fp8"), batch=1, context=1)
    assert fp8.step_time_s == pytest.approx(bf16.step_time_s / 2, rel=0.01)


def test_moe_batch_touches_more_experts(deploy):
    d = deploy("Mixtral-8x7B", tp=2)
    one, many = step_time(d, 1, 1), step_time(d, 256, 1)
    # batch 1 reads ~12.9B active params; a big batch reads nearly all 46.7B.
    assert one.weight_bytes == pytest.approx(12.75e9 * 2, rel=0.01)
    assert many.weight_bytes == pytest.approx(46.57e9 * 2, rel=0.01)


def test_calibration_scales_the_bound(deploy):
    cal = Calibration(bandwidth_fraction=0.5, step_overhead_s=0.001)
    ideal = plan_decode(deploy(tp=1), 1, 1).step_time_s
    real = plan_decode(deploy(tp=1, calibration=cal), 1, 1).step_time_s
    assert real == pytest.approx(2 * ideal + 0.001)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2048), context=st.integers(1, 32768))
def test_step_time_monotone_in_batch_and_context(batch, context):
    from servelm.planner.deployment import Deployment
    from servelm.planner.hardware import get_accelerator
    from servelm.planner.model_catalog import builtin_model

    d = Deployment(builtin_model("Qwen3-30B-A3B"), get_accelerator("H200"), tp=2)
    s = step_time(d, batch, context).step_s
    assert step_time(d, batch + 1, context).step_s >= s
    assert step_time(d, batch, context + 1).step_s >= s


def test_tp_divides_time(deploy):
    d1, d4 = deploy("Llama-3.1-70B", tp=1), deploy("Llama-3.1-70B", tp=4)
    assert step_time(d4, 8, 1024).step_s == pytest.approx(step_time(d1, 8, 1024).step_s / 4)


def test_plan_fields(deploy):
    p = plan_decode(dataclasses.replace(deploy(tp=1)), 64, 2048)
    assert p.tokens_per_s_per_gpu == pytest.approx(64 / p.step_time_s)
    assert {"step_time_s", "ridge_batch"} <= set(p.fields())
