"""GGUF config and weights of the default model, checked against transformers' GGUF loader."""

import numpy as np
import pytest
import torch

from servelm.loader import iter_weights, load_model_config
from servelm.loader.gguf_loader import hf_name, unpermute_rotary
from servelm.loader.hf_loader import hf_weight_names


@pytest.fixture(scope="session")
def gguf_config(gguf_source):
    return load_model_config(gguf_source)


@pytest.fixture(scope="session")
def gguf_weights(gguf_source, gguf_config):
    return dict(iter_weights(gguf_source, gguf_config))


def test_default_model_config(gguf_config, gguf_source):
    c = gguf_config
    assert c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tie_word_embeddings is True
    assert c.rope_theta == 100000.0
    assert c.rope_scaling is None
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.attention_bias is False and c.qk_norm is False
    assert c.bos_token_id == 1
    # <|im_end|> is the declared EOS; <|endoftext|> ends generation too.
    assert c.eos_token_ids == (2, 0)
    assert c.name == gguf_source.name == "SmolLM2-135M-Instruct.Q4_1"


def test_weight_names_and_shapes(gguf_weights, gguf_config):
    assert sorted(gguf_weights) == sorted(hf_weight_names(gguf_config))
    assert "lm_head.weight" not in gguf_weights  # tied
    c = gguf_config
    assert gguf_weights["model.embed_tokens.weight"].shape == (c.vocab_size, c.hidden_size)
    assert gguf_weights["model.layers.0.self_attn.q_proj.weight"].shape == (c.q_size, c.hidden_size)
    assert gguf_weights["model.layers.0.self_attn.k_proj.weight"].shape == (
        c.kv_size,
        c.hidden_size,
    )
    assert gguf_weights["model.layers.0.self_attn.o_proj.weight"].shape == (c.hidden_size, c.q_size)
    assert gguf_weights["model.layers.0.mlp.down_proj.weight"].shape == (
        c.hidden_size,
        c.intermediate_size,
    )
    assert gguf_weights["model.norm.weight"].shape == (c.hidden_size,)
    assert all(w.dtype == torch.float32 and w.device.type == "cpu" for w in gguf_weights.values())


def test_weights_equal_transformers_gguf_loading(gguf_weights, reference_gguf_tensors):
    """Every tensor, q/k included, equals transformers' dequantized and un-permuted one.

    The q/k equality is what proves the rotary un-permutation: without it the rows differ.
    """
    assert set(gguf_weights) == set(reference_gguf_tensors)
    for name, ours in gguf_weights.items():
        ref = reference_gguf_tensors[name].to(torch.float32)
        assert torch.equal(ours, ref), name


def test_q_weight_is_actually_permuted_in_the_file(
    gguf_weights, reference_gguf_tensors, gguf_source
):
    """Guard against a vacuous pass: the raw (still permuted) q rows differ from HF's order."""
    from gguf.quants import dequantize

    from servelm.loader.gguf_loader import gguf_reader

    reader = gguf_reader(gguf_source.path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw_rows = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())
    hf = reference_gguf_tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(raw_rows, hf)
    assert torch.equal(gguf_weights["model.layers.0.self_attn.q_proj.weight"], hf)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to q/k rows of llama models.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("shape,n_head", [((8 * 6, 5), 6), ((2 * 4, 3), 2), ((4 * 8,), 4)])
def test_unpermute_inverts_llama_cpp_permute(shape, n_head):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary(permuted, n_head), w)
    ref = LlamaTensorProcessor()._reverse_permute_weights(permuted, n_head, n_head)
    np.testing.assert_array_equal(unpermute_rotary(permuted, n_head), ref)


def test_tensor_name_mapping():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.12.attn_k_norm.weight") == "model.layers.12.self_attn.k_norm.weight"
    assert hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="ssm_conv"):
        hf_name("blk.0.ssm_conv.weight")
