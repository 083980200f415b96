"""KV-cache sizes against published per-token figures."""

import pytest

from servelm.planner.errors import PlanInputError
from servelm.planner.kv import plan_kv
from servelm.planner.model_catalog import builtin_model


def test_llama_3_1_70b_320_kib_per_token_43_gb_at_128k():
    # 80 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes = 327,680 B = 320 KiB/token, the
    # figure in e.g. NVIDIA's "Mastering LLM Techniques: Inference Optimization" KV formula;
    # x 131,072 tokens = 42.9 GB for one full-context request.
    p = plan_kv(builtin_model("Llama-3.1-70B"), "bf16", 131072)
    assert p.kv_bytes_per_token == 320 * 1024
    assert p.kv_bytes_per_request == pytest.approx(43e9, rel=0.01)


def test_deepseek_v3_mla_per_token():
    # DeepSeek-V2 paper (arXiv:2405.04434), Table 1: MLA caches (d_c + d_h^R) x l elements
    # per token; DeepSeek-V3 config: d_c = 512, d_h^R = 64, l = 61 -> 35,136 elements.
    p = plan_kv(builtin_model("DeepSeek-V3"), "bf16", 1)
    assert p.kv_bytes_per_token == (512 + 64) * 61 * 2
    assert p.attention == "MLA"


def test_llama_2_7b_mha_half_megabyte_per_token():
    # Llama-2-7B (MHA, 32 layers x 4096 wide): 2 x 32 x 4096 x 2 B = 512 KiB/token, the
    # "~0.5 MB per token" figure quoted in vLLM's PagedAttention paper (OPT-13B: 800 KB,
    # same formula) and most KV-cache explainers.
    assert plan_kv(builtin_model("Llama-2-7B"), "fp16").kv_bytes_per_token == 512 * 1024


def test_fp8_halves_bf16():
    m = builtin_model("Qwen2.5-7B")
    assert plan_kv(m, "fp8").kv_bytes_per_token * 2 == plan_kv(m, "bf16").kv_bytes_per_token


def test_layout_table_ratios():
    rows = {r["layout"].split(" ")[0]: r for r in plan_kv(builtin_model("Llama-3.1-70B")).table}
    own = rows["GQA-8"]
    assert "this model" in own["layout"]
    assert rows["MHA"]["kv_bytes_per_token"] == 8 * own["kv_bytes_per_token"]  # 64 vs 8 heads
    assert rows["MQA"]["kv_bytes_per_token"] * 8 == own["kv_bytes_per_token"]
    # MLA at DeepSeek-V2's ratios: latent 4 x 128 + rope 64 = 576 vs GQA-8's 2048 elements.
    assert rows["MLA"]["vs_this_model"] == pytest.approx(576 / 2048, abs=1e-3)


def test_mla_model_compares_against_its_mha_form():
    rows = plan_kv(builtin_model("DeepSeek-V3")).table
    mha = next(r for r in rows if r["layout"] == "MHA")
    # 128 heads x (K 192 + V 128) per layer vs 576 latent elements: ~71x (DeepSeek-V2 paper
    # reports MLA cutting the KV cache by 93.3% vs its MHA 67B predecessor).
    assert mha["vs_this_model"] == pytest.approx(128 * 320 / 576, rel=1e-3)
    assert sum("this model" in r["layout"] for r in rows) == 1


def test_bad_inputs_name_the_flag():
    m = builtin_model("Llama-3.1-8B")
    with pytest.raises(PlanInputError, match="--kv-dtype"):
        plan_kv(m, "int3")
    with pytest.raises(PlanInputError, match="--context"):
        plan_kv(m, "bf16", 0)
