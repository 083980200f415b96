"""Phi-3 GGUF files (fused attn_qkv and gate|up in ffn_up, LongRoPE factors as tensors, a
sliding window on every layer), written with gguf-py's GGUFWriter and name map from a tiny
transformers checkpoint, load to the checkpoint's logits and greedy tokens."""

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.config import EngineArgs, ModelConfig
from tiny_families import make_tiny_family_model


def _write(path, model):
    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    orig = rope["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    scale = cfg.max_position_embeddings / orig  # llama.cpp's converter: its attention factor
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    tokens = [f"<t{i}>" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_eos_token_id(0)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{name_map.get_name(base)}.{suffix}", tensor.numpy().astype(np.float32),
                     raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def phi3_file(tmp_path_factory):
    model = make_tiny_family_model("phi3", seed=5)
    path = tmp_path_factory.mktemp("phi3") / "tiny-phi3.gguf"
    _write(path, model)
    return model, path


def test_config_from_metadata(phi3_file):
    from servelm.loader import load_model_config, resolve_model

    model, path = phi3_file
    got = load_model_config(resolve_model(str(path)))
    want = ModelConfig.from_hf_config(model.config.to_dict())
    assert got.architecture == "phi3"
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                  "num_kv_heads", "head_dim", "sliding_window", "layer_types",
                  "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_scaling["rope_type"] == "longrope"
    assert got.rope_scaling["long_factor"] == pytest.approx(want.rope_scaling["long_factor"])
    assert got.rope_scaling["short_factor"] == pytest.approx(want.rope_scaling["short_factor"])


def test_logits_and_greedy_match_transformers(phi3_file):
    """A prompt past the window (16) and into the long factors' range is not needed for
    parity: 40 tokens cross the window; positions stay below the original 256."""
    from servelm.engine_builder import build_engine
    from servelm.protocol import EngineRequest, SamplingParams
    from tiny_models import prefill_logits

    model, path = phi3_file
    engine = build_engine(EngineArgs(model=str(path), num_blocks=64, block_size=4,
                                     prepared_weights_cache=False))
    prompt = [(7 * i + 3) % 384 for i in range(40)]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompt), ref, atol=1e-4, rtol=1e-4)
    engine.add_request(EngineRequest("g", prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                                 ignore_eos=True)))
    out = []
    while engine.has_unfinished:
        out += [t for d in engine.step() for t in d.token_ids]
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == gen


def test_a_window_on_an_architecture_without_a_known_pattern_is_refused():
    def get(key, default=None):
        return {"general.architecture": "llama", "llama.attention.sliding_window": 4096}.get(
            key, default)

    from servelm.config import _gguf_sliding_window

    with pytest.raises(ValueError, match="llama.attention.sliding_window"):
        _gguf_sliding_window("llama", get, 2)
    gemma = _gguf_sliding_window("gemma2", lambda k, d=None: 8 if "sliding" in k else d, 4)
    assert gemma == {"sliding_window": 8, "layer_types": (
        "sliding_attention", "full_attention", "sliding_attention", "full_attention")}
