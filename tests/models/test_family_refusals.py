"""What servelm does not implement is refused at load with an error naming the field, never
run wrong; and where the CPU decode stack cannot run a family's steps, they run eagerly and the
start-up reason says why."""

from types import SimpleNamespace

import pytest

from tiny_families import make_tiny_family_model
from tiny_models import make_tiny_engine, make_tiny_hf_model
from servelm.config import ModelConfig


def _llama_cfg(**extra):
    return {"model_type": "llama", "vocab_size": 384, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024, **extra}


def _build(config: ModelConfig, **kw):
    from servelm.engine_builder import build_model
    import torch

    return build_model(config, iter(()), torch.float32, torch.device("cpu"), **kw)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"type": "ntk-by-parts", "factor": 2.0}])
def test_unknown_rope_type_is_refused_naming_the_field(rope):
    config = ModelConfig.from_hf_config(_llama_cfg(rope_scaling=rope))
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type"):
        _build(config)


def test_gemma3_sliding_layers_with_scaled_rope_are_refused():
    cfg = _llama_cfg(model_type="gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"rope_parameters\.sliding_attention\.rope_type"):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("field, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [1])])
def test_moe_layouts_not_implemented_are_refused(field, value):
    cfg = _llama_cfg(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, **{field: value})
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(cfg)


def test_leading_mlp_only_layers_are_dense_layers():
    cfg = _llama_cfg(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, mlp_only_layers=[0])
    assert ModelConfig.from_hf_config(cfg).num_leading_dense_layers == 1


def test_unknown_layer_type_is_refused():
    cfg = _llama_cfg(model_type="gemma2", sliding_window=8,
                     layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config(cfg)


def test_unknown_activation_is_refused():
    config = ModelConfig.from_hf_config(_llama_cfg(model_type="mixtral", num_local_experts=4,
                                                   num_experts_per_tok=2, hidden_act="relu2"))
    with pytest.raises(ValueError, match="hidden_act"):
        _build(config)


def test_quantizing_a_new_family_is_refused_naming_it():
    """Gemma takes no method; the MoE families take the weight-only ones and gguf
    (tests/models/test_moe_quantized.py, tests/loader/test_gguf_moe.py) and refuse the others
    by name."""
    config = ModelConfig.from_hf_config(_llama_cfg(model_type="gemma2", sliding_window=8))
    with pytest.raises(ValueError, match="'int8' is not supported for the gemma2 family"):
        _build(config, quantization="int8")
    # (the MoE families' refusals: tests/models/test_moe_quantized.py)


def test_backend_without_variants_is_refused_for_a_window_or_softcap():
    from servelm.models.decoder import Attention

    config = ModelConfig.from_hf_config(_llama_cfg(model_type="gemma2", sliding_window=8,
                                                   attn_logit_softcapping=50.0))
    plain = SimpleNamespace(name="plain", supports_variants=False)  # an AttentionBackend's
    attn = Attention(config, 0, None, backend=plain)

    class Batch:
        seq_lens = [4]

    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        attn._variants(Batch())


def test_cpu_decode_stack_leaves_latent_attention_eager_without_its_kernel():
    """The stack runs latent attention on the C++ latent kernel only; with the attention
    backend on torch (--cpu-kernels attention=torch) the steps run eagerly, and say why."""
    engine = make_tiny_engine(make_tiny_family_model("deepseek_v2"),
                              cpu_kernels="attention=torch")
    assert engine.runner.cpu_stack is None
    assert "latent-attention decode kernel" in engine.runner.cpu_stack_refusal


def test_cpu_decode_stack_still_takes_llama_with_yarn():
    from servelm.cpu_kernels import ops_for_mode

    engine = make_tiny_engine(make_tiny_family_model("qwen2_yarn"))
    if ops_for_mode("decode", "auto") is None:
        pytest.skip("the C++ kernels do not build here")
    assert engine.runner.cpu_stack is not None
    assert make_tiny_engine(make_tiny_hf_model("llama")).runner.cpu_stack is not None


def test_mla_cache_holds_the_latent_and_rope_key_only():
    from servelm.cost import kv_elems_per_token_layer
    from servelm.attention.kv_cache import KVCache

    hf = make_tiny_family_model("deepseek_v2")
    engine = make_tiny_engine(hf)
    config = engine.model_config
    cache = engine.runner.kv_cache
    assert cache.k.shape[2:] == (1, config.kv_lora_rank + config.qk_rope_head_dim)
    assert cache.v.numel() == 0
    assert kv_elems_per_token_layer(config) == config.kv_lora_rank + config.qk_rope_head_dim
    per_block = KVCache.bytes_per_block(config, cache.block_size, cache.k.dtype)
    assert per_block * cache.num_blocks == cache.k.numel() * cache.k.element_size()


def test_fp8_kv_cache_is_refused_for_mla():
    hf = make_tiny_family_model("deepseek_v2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_tiny_engine(hf, kv_cache_dtype="fp8")


@pytest.mark.parametrize("field, value", [("topk_method", "sinkhorn"),
                                          ("scoring_func", "sigmoid")])
def test_deepseek_routing_not_implemented_is_refused(field, value):
    cfg = _llama_cfg(model_type="deepseek_v2", n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, kv_lora_rank=32, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=16, **{field: value})
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("model_type, extra, expected", [
    ("gemma2", {}, ["sliding_attention", "full_attention"] * 3),
    ("gemma3_text", {"sliding_window_pattern": 3}, ["sliding_attention"] * 2
     + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 4},
     ["full_attention"] * 4 + ["sliding_attention"] * 2),
])
def test_configs_without_layer_types_get_the_family_pattern(model_type, extra, expected):
    """Older config.json files have a window but no layer_types: the family's pattern, as
    transformers derives it."""
    import transformers

    cfg = _llama_cfg(model_type=model_type, num_hidden_layers=6, sliding_window=8, **extra)
    config = ModelConfig.from_hf_config(cfg)
    assert list(config.layer_types) == expected
    hf_cls = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
              "qwen2": "Qwen2Config"}[model_type]
    hf = getattr(transformers, hf_cls)(num_hidden_layers=6, sliding_window=8, **extra)
    assert list(hf.layer_types) == expected


def test_deepseek_multi_token_prediction_layers_are_skipped_and_said(caplog):
    """V3 checkpoints hold their MTP module as a layer past num_hidden_layers: skipped at
    load with a log line; the model is the one without it. A stray tensor is still refused."""
    import logging

    import torch

    from tiny_families import make_tiny_family_model
    from tiny_models import make_tiny_engine, prefill_logits

    hf = make_tiny_family_model("deepseek_v3")
    n = hf.config.num_hidden_layers
    state = dict(hf.state_dict())
    mtp = {k.replace("model.layers.0.", f"model.layers.{n}."): v.clone()
           for k, v in state.items() if k.startswith("model.layers.0.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    mtp[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    from servelm.config import EngineArgs, ModelConfig
    from servelm.engine_builder import assemble_engine

    config = ModelConfig.from_hf_config(hf.config.to_dict())
    with caplog.at_level(logging.INFO, logger="servelm.models.deepseek"):
        engine = assemble_engine(EngineArgs(model="tiny", num_blocks=64, block_size=4), config,
                                 [*state.items(), *mtp.items()], None, "tiny")
    assert any("multi-token-prediction" in r.message for r in caplog.records)
    prompt = [3, 9, 27, 81, 243]
    torch.testing.assert_close(prefill_logits(engine, prompt),
                               prefill_logits(make_tiny_engine(hf), prompt))
    with pytest.raises(ValueError, match="has no place"):
        assemble_engine(EngineArgs(model="tiny", num_blocks=64, block_size=4), config,
                        [*state.items(), ("model.layers.0.mystery.weight", torch.zeros(2))],
                        None, "tiny")
