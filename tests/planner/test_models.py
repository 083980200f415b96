"""Parameter counts recomputed from catalog shapes against published totals."""

import json

import pytest

from servelm.cost import count_params, expected_experts_touched
from servelm.planner.errors import PlanInputError
from servelm.planner.model_catalog import (
    builtin_model,
    catalog_names,
    from_hf_config,
    resolve_model,
)


def params(name):
    return count_params(builtin_model(name))


def close(x, target, rel):
    return abs(x - target) / target <= rel


def test_deepseek_v3_671b_total_37b_active():
    # DeepSeek-V3 Technical Report (arXiv:2412.19437), abstract: "671B total parameters with
    # 37B activated for each token" (main model, excluding the 14B multi-token-prediction head).
    b = params("DeepSeek-V3")
    assert close(b.total, 671e9, 0.005)
    assert close(b.active, 37e9, 0.03)


def test_llama_3_1_sizes():
    # Meta Llama 3.1 model card: 8B, 70B, 405B; HF safetensors metadata lists 8.03B, 70.6B, 406B.
    assert close(params("Llama-3.1-8B").total, 8.03e9, 0.002)
    assert close(params("Llama-3.1-70B").total, 70.55e9, 0.002)
    assert close(params("Llama-3.1-405B").total, 405.85e9, 0.002)


def test_mixtral_total_and_active():
    # Mixtral of Experts (arXiv:2401.04088), sec. 2: 47B total (46.7B), 13B active (12.9B).
    b = params("Mixtral-8x7B")
    assert close(b.total, 46.7e9, 0.005)
    assert close(b.active, 12.9e9, 0.005)


def test_qwen_sizes_and_non_embedding():
    # Qwen2.5-7B model card: 7.61B parameters, 6.53B non-embedding.
    b = params("Qwen2.5-7B")
    assert close(b.total, 7.61e9, 0.002)
    assert close(b.total - b.embedding - b.lm_head, 6.53e9, 0.002)
    # Qwen3-0.6B model card: 0.6B parameters, 0.44B non-embedding (tied embeddings).
    b = params("Qwen3-0.6B")
    assert b.lm_head == 0
    assert close(b.total, 0.6e9, 0.01)
    assert close(b.total - b.embedding, 0.44e9, 0.01)
    # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
    b = params("Qwen3-30B-A3B")
    assert close(b.total, 30.5e9, 0.005)
    assert close(b.active, 3.3e9, 0.02)


def test_small_models():
    # SmolLM2-135M: 134.5M in the HF safetensors metadata; Llama-2-7B paper table: 6.7B.
    assert close(params("SmolLM2-135M").total, 134.5e6, 0.002)
    assert close(params("Llama-2-7B").total, 6.74e9, 0.002)


def test_dense_models_are_fully_active():
    for name in catalog_names():
        b = params(name)
        assert b.active <= b.total
        assert (b.active == b.total) == (not builtin_model(name).is_moe)


def test_attention_kinds():
    kinds = {n: builtin_model(n).attention_kind for n in catalog_names()}
    assert kinds["Llama-2-7B"] == "MHA"
    assert kinds["Llama-3.1-70B"] == "GQA"
    assert kinds["DeepSeek-V3"] == "MLA"


def test_expected_experts_touched_limits():
    m = builtin_model("DeepSeek-V3")
    assert expected_experts_touched(m, 1) == pytest.approx(8)
    assert expected_experts_touched(m, 10_000) == pytest.approx(256, rel=1e-6)
    assert expected_experts_touched(builtin_model("Llama-3.1-8B"), 64) == 0


def test_lookup_by_repo_id_and_case():
    assert builtin_model("meta-llama/Llama-3.1-70B").name == "Llama-3.1-70B"
    assert builtin_model("deepseek-v3").name == "DeepSeek-V3"
    with pytest.raises(PlanInputError) as e:
        builtin_model("GPT-5")
    assert e.value.param == "--model"


def test_load_config_json_file_and_dir(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 100, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for arg in (tmp_path, tmp_path / "config.json"):
        m = resolve_model(str(arg))
        assert (m.num_layers, m.num_kv_heads, m.head_dim) == (2, 2, 16)
        # embed 6400 + 2 layers x (attn 64*(2*4+2*2)*16 = 12288 + mlp 24576 + norms 128) + 64
        assert count_params(m).total == 6400 + 2 * (12288 + 24576 + 128) + 64


def test_text_config_is_unwrapped():
    inner = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128}
    m = from_hf_config({"model_type": "llava", "text_config": inner})
    assert m.hidden_size == 64


def test_bad_configs_name_the_flag(tmp_path):
    with pytest.raises(PlanInputError, match="--model"):
        from_hf_config({"model_type": "llama"})
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(PlanInputError, match="--model"):
        resolve_model(str(tmp_path / "bad.json"))
    with pytest.raises(PlanInputError, match="--model"):
        resolve_model(str(tmp_path / "missing.gguf"))
