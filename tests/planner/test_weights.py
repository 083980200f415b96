import pytest

from servelm.planner.errors import PlanInputError
from servelm.planner.model_catalog import builtin_model
from servelm.planner.weights import plan_weights


def test_llama_70b_bf16_about_141_gb():
    # 70.55B parameters x 2 bytes; HF's Llama-3.1-70B bf16 safetensors total ~141 GB.
    p = plan_weights(builtin_model("Llama-3.1-70B"), "bf16")
    assert p.weight_bytes == pytest.approx(141e9, rel=0.005)
    assert p.active_params == p.total_params


def test_deepseek_v3_fp8_checkpoint_size():
    # DeepSeek-V3 ships FP8 weights; 671B params x 1 byte ~ 671 GB (its HF repo is ~688 GB
    # including the 14B MTP module and fp32 block scales).
    p = plan_weights(builtin_model("DeepSeek-V3"), "fp8")
    assert p.weight_bytes == pytest.approx(671e9, rel=0.005)
    assert p.active_weight_bytes == pytest.approx(37.5e9, rel=0.02)


def test_table_scales_with_dtype_and_chain_ends_in_fields():
    p = plan_weights(builtin_model("Llama-3.1-8B"), "int4")
    by = {r["dtype"]: r["weight_bytes"] for r in p.table}
    assert by["fp32"] == 2 * by["bf16"] == 4 * by["fp8"] == 8 * by["int4"]
    assert p.weight_bytes == by["int4"]
    names = [s.name for s in p.steps]
    assert "total_params" in names and "weight_bytes" in names


def test_unknown_dtype():
    with pytest.raises(PlanInputError, match="--weight-dtype"):
        plan_weights(builtin_model("Llama-3.1-8B"), "int2")
