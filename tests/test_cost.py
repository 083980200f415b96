"""servelm.cost: one count of parameters, bytes and FLOPs for the planner, the server's
metrics and the benchmarks, checked by hand on the default model's shapes (read from its
GGUF file) and on tiny configs; one definition of attention pairs, which the engine's step
stats use too."""

from __future__ import annotations

import pytest

from servelm import cost
from servelm.config import ModelConfig

# SmolLM2-135M by hand: 30 layers, hidden 576, MLP 1536, 9 heads of 64, 3 KV heads, vocab
# 49152, tied embeddings.
LINEARS_PER_LAYER = 576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536  # q k v o, gate up down
NORMS = 30 * 2 * 576 + 576
HEAD = 49152 * 576


@pytest.fixture(scope="module")
def default_config(default_model_path):
    from servelm.loader.gguf_loader import load_gguf_config

    return load_gguf_config(default_model_path, "default")


def test_default_model_shapes_and_params(default_config):
    c = default_config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == \
        (30, 576, 1536, 9, 3, 64, 49152, True)
    assert c.gguf_weight_type == "Q4_1" and not c.is_moe and not c.is_mla
    assert cost.count_params(c).total == 30 * LINEARS_PER_LAYER + NORMS + HEAD  # 134.5M


@pytest.mark.parametrize("quantization,linear,head", [
    (None, 4, 4),  # float32: every weight 4 bytes (PackedLinear or nn.Linear alike)
    ("int8", 1 + 4 / 576, 1 + 4 / 576),  # int8 + a float32 scale per row (~hidden inputs)
    ("int4-g32", 0.5 + 2 * 2 / 32, 1 + 4 / 576),  # nibbles + bf16 (scale, zero) per 32
    ("gguf", 0.5 + 2 * 4 / 32, 1 + 4 / 32),  # Q4_1 as int4-g32 with float32 (scale, zero)
])
def test_weight_bytes_of_one_decode_step_by_hand(default_config, quantization, linear, head):
    wb = cost.weight_bytes_per_param(default_config, quantization, "float32")
    expected = 30 * LINEARS_PER_LAYER * linear + HEAD * head + NORMS * 4
    assert cost.weight_bytes_read_per_step(default_config, 1, wb) == pytest.approx(expected)


def test_kv_bytes_per_token_auto_fp8_and_mla():
    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 2048)
    assert cost.kv_bytes_per_token(smol, cost.kv_dtype_bytes("auto", "float32")) == \
        2 * 30 * 3 * 64 * 4
    assert cost.kv_bytes_per_token(smol, cost.kv_dtype_bytes("fp8", "bfloat16")) == \
        2 * 30 * 3 * 64
    assert smol.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    mla = smol.replace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                       v_head_dim=128)
    assert cost.kv_bytes_per_token(mla, 2) == 30 * (512 + 64) * 2


def test_attention_pairs_is_causal():
    assert cost.attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert cost.attention_pairs(10, 1) == 11  # a decode sees its context and itself
    assert cost.attention_pairs(10, 3) == 11 + 12 + 13
    assert isinstance(cost.attention_pairs(5, 3), int)


def test_step_cost_by_hand():
    c = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 64, tie_word_embeddings=True)
    layer = 64 * (64 + 32 + 32 + 64) + 3 * 64 * 128 + 2 * 64
    kv_tok = 2 * 2 * 2 * 16 * 4
    # two decodes at contexts 10 and 20: 30 + 2 keys read, 2 written; 11 + 21 pairs
    s = cost.step_cost(c, 4, kv_tok, num_tokens=2, num_context_tokens=11 + 21,
                       num_attention_pairs=11 + 21)
    assert s.weight_bytes == (2 * layer + 64 + 100 * 64) * 4
    assert s.kv_bytes == (32 + 2) * kv_tok
    assert s.flops == 2 * (2 * 2 * layer + 2 * 100 * 64) + 32 * 2 * 2 * 4 * (16 + 16)
    assert s.bytes == s.weight_bytes + s.kv_bytes


def test_engine_step_stats_count_pairs_as_the_cost_module(tiny_hf, tiny_engine):
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    engine = tiny_engine(tiny_hf("llama"), max_num_batched_tokens=64)
    LLM(engine=engine).generate([list(range(1, 8))], SamplingParams(max_tokens=1),
                                use_tqdm=False)
    assert engine.stats.last_num_attention_pairs == cost.attention_pairs(0, 7)
    assert engine.stats.last_num_context_tokens == 7


def test_moe_and_mla_configs_are_read_for_planning():
    from servelm.models import get_model_class

    ds = ModelConfig.from_hf_config({
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "vocab_size": 129280})
    assert ds.architecture == "deepseek_v3" and ds.is_moe and ds.is_mla
    assert ds.num_moe_layers == 58 and ds.attention_kind == "MLA"
    b = cost.count_params(ds)
    assert abs(b.total - 671e9) / 671e9 < 0.005 and abs(b.active - 37e9) / 37e9 < 0.03
    assert get_model_class(ds.architecture).__name__ == "DeepseekV3ForCausalLM"
    jamba = ModelConfig.from_hf_config({
        "model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
        "num_attention_heads": 4})
    with pytest.raises(ValueError, match="'jamba' is not supported by the engine"):
        get_model_class(jamba.architecture)  # planned, never built
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 10})
