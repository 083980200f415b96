"""Gemma 2 and Gemma 3 GGUF files as llama.cpp's converter writes them (norm weights stored
as 1 + w, soft-caps as keys, no query_pre_attn_scalar, sliding layers by llama.cpp's fixed
pattern, Gemma 3's local rope base and linear-scaled global rope), from tiny transformers
checkpoints with gguf-py's writer and name map: the same config, logits and greedy tokens."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from servelm.config import ModelConfig
from gguf_families import add_shape, add_word_vocab, assert_matches_transformers, finish
from tiny_families import make_tiny_family_model

_GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def _model(family):
    if family == "gemma2":  # the file cannot carry another attention scale than head_dim's
        return make_tiny_family_model("gemma2", seed=2, query_pre_attn_scalar=16)
    return make_tiny_family_model("gemma3", seed=2, query_pre_attn_scalar=16,
                                  num_hidden_layers=6, layer_types=_GEMMA3_TYPES)


def _write(path, family, model):
    cfg = model.config
    arch = family
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if family == "gemma2":
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(float(full["rope_theta"]))
        w.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    add_word_vocab(w, cfg.vocab_size)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's converter for Gemma
        w.add_tensor(f"{name_map.get_name(base)}.{suffix}", array, raw_dtype=Q.F32)
    finish(w)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_file(request, tmp_path_factory):
    family = request.param
    model = _model(family)
    path = tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf"
    _write(path, family, model)
    return family, model, path


def test_config_from_metadata(gemma_file):
    from servelm.loader import load_model_config, resolve_model

    family, model, path = gemma_file
    got = load_model_config(resolve_model(str(path)))
    want = ModelConfig.from_hf_config(model.config.to_dict())
    for field in ("architecture", "num_layers", "hidden_size", "head_dim", "num_kv_heads",
                  "hidden_act", "sliding_window", "layer_types", "attn_logit_softcapping",
                  "final_logit_softcapping", "query_pre_attn_scalar", "qk_norm",
                  "tie_word_embeddings", "rope_local_theta"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_theta == pytest.approx(want.rope_theta)
    if family == "gemma3":
        assert got.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_logits_and_greedy_match_transformers(gemma_file):
    """24 tokens: past the window of 8 on the sliding layers."""
    family, model, path = gemma_file
    prompt = [(11 * i + 5) % 384 for i in range(24)]
    assert_matches_transformers(model, path, prompt, 10)