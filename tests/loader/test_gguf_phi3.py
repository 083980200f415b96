"""Phi-3 GGUF files (fused attn_qkv and gate|up in ffn_up, LongRoPE factors as tensors, a
sliding window on every layer), written with gguf-py's GGUFWriter and name map from a tiny
transformers checkpoint, load to the checkpoint's logits and greedy tokens."""

import math

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from servelm.config import ModelConfig
from gguf_families import add_shape, add_word_vocab, assert_matches_transformers, finish
from tiny_families import make_tiny_family_model


def _write(path, model):
    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "phi3")
    add_shape(w, cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_sliding_window(cfg.sliding_window)
    orig = rope["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    scale = cfg.max_position_embeddings / orig  # llama.cpp's converter: its attention factor
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_word_vocab(w, cfg.vocab_size)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{name_map.get_name(base)}.{suffix}", tensor.numpy().astype(np.float32),
                     raw_dtype=Q.F32)
    finish(w)


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
    """40 tokens: past the window of 16, below the original context of 256 (short factors)."""
    model, path = phi3_file
    prompt = [(7 * i + 3) % 384 for i in range(40)]
    assert_matches_transformers(model, path, prompt, 10)


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
