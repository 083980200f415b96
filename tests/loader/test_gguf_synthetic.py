"""GGUF files written here with gguf-py's GGUFWriter from tiny random HF models.

Covers what the default model cannot: qwen2 (q/k/v bias, tied, yarn) and qwen3 (q/k norm,
head_dim != hidden / heads) metadata, F16 and Q8_0 tensors, rope scaling keys, and a byte-level
vocabulary with user-defined tokens, NFC normalization and a BOS. GGUF tensor names come from
gguf-py's own TensorNameMap, not from the loader's table.
"""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers.pre_tokenizers import ByteLevel

from servelm.loader import iter_weights, load_model_config, load_tokenizer, resolve_model
from tiny_models import make_tiny_hf_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ã ©"]


def _vocab():
    tokens = SPECIALS + USER_DEFINED + sorted(ByteLevel.alphabet())
    tokens += ["Ġt", "he", "Ġthe", "Ã©"]
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (len(tokens) - 4)
    return tokens, types


def _hf_model(family):
    tokens, _ = _vocab()
    extra = {"qwen3": {"head_dim": 32}}.get(family, {})
    model = make_tiny_hf_model(family, vocab_size=len(tokens), hidden_size=64,
                               intermediate_size=96, max_position_embeddings=512,
                               tie_word_embeddings=family == "qwen2", **extra)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p.data)
    return model


def _llama_cpp_permute(w, n_head):
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _qtype(name):
    if name.endswith("embed_tokens.weight"):
        return Q.F16
    if "_proj.weight" in name:
        return Q.Q8_0
    return Q.F32


def _write_metadata(w, arch, cfg):
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(20000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        w.add_key_length(32)
    if arch == "qwen2":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)
    tokens, types = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}")


def _write_gguf(path, arch, model):
    """The file llama.cpp's converter would write, plus the values each tensor should load as."""
    cfg = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    _write_metadata(w, arch, cfg)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy().astype(np.float32)
        qtype = _qtype(name)
        stored = dequantize(quantize(array, qtype), qtype) if qtype != Q.F32 else array
        expected[name] = torch.from_numpy(np.array(stored, dtype=np.float32))
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        data = quantize(array, qtype) if qtype != Q.F32 else array
        w.add_tensor(f"{name_map.get_name(base)}.{suffix}", data, raw_dtype=qtype)
    if arch == "llama":  # Llama 3 style per-frequency rope factors
        w.add_tensor("rope_freqs.weight", np.linspace(1, 8, 8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _make(arch, tmp_path_factory):
    model = _hf_model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    expected = _write_gguf(path, arch, model)
    return arch, model, expected, resolve_model(str(path))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def synthetic(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory)


def test_config_from_metadata(synthetic):
    arch, model, _, source = synthetic
    c = load_model_config(source)
    assert c.architecture == arch and c.name == f"tiny-{arch}"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (2, 64, 96)
    assert (c.num_heads, c.num_kv_heads) == (4, 2)
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.vocab_size == len(_vocab()[0]) == model.config.vocab_size
    assert c.rope_theta == 20000.0 and c.rms_norm_eps == pytest.approx(1e-6)
    assert c.max_position_embeddings == 512
    assert c.tie_word_embeddings == (arch == "qwen2")
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert (c.bos_token_id, c.eos_token_ids) == (1, (0, 2))
    scaling = {
        "llama": {"rope_type": "freq_factors", "freq_factors": list(np.linspace(1, 8, 8))},
        "qwen2": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        "qwen3": None,
    }[arch]
    assert c.rope_scaling == scaling


def test_weights_round_trip(synthetic):
    arch, _, expected, source = synthetic
    ours = dict(iter_weights(source, load_model_config(source)))
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_byte_level_tokenizer_from_metadata(tmp_path_factory):
    _, _, _, source = _make("qwen2", tmp_path_factory)  # pre-tokenizer "qwen2", add_bos=1
    tok = load_tokenizer(source)
    the, think, im_end = tok.token_to_id("Ġthe"), tok.token_to_id("<think>"), 2
    # add_bos_token=1 in the file: BOS first, and only when special tokens are asked for.
    assert tok.encode("<think> the<|im_end|>") == [1, think, the, im_end]
    assert tok.encode(" the", add_special_tokens=False) == [the]
    # qwen2 pre-tokenizer normalizes to NFC: "e" + combining acute == "é".
    assert tok.encode("e\u0301", add_special_tokens=False) == tok.encode(
        "é", add_special_tokens=False
    )
    assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False)) == ["Ã©"]
    assert tok.is_special(im_end) and not tok.is_special(think)
    assert tok.decode(tok.encode("<think> the<|im_end|>")) == "<think> the"
    assert tok.eos_token_ids == (0, 2)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_qwen2_pre_tokenizer_matches_transformers_qwen2_tokenizer(tmp_path_factory):
    """Same vocab and merges through transformers' Qwen2Tokenizer (its split regex + NFC)."""
    from transformers import Qwen2Tokenizer

    _, _, _, source = _make("qwen2", tmp_path_factory)
    ours = load_tokenizer(source)
    tokens, _ = _vocab()
    ref = Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in MERGES]
    )
    for text in ["I'm  the\n\n\n the12345 théé e\u0301!!", "  x\r\n\ty", "ΑΒΓ 数学 😀"]:
        assert (
            ours.encode(text, add_special_tokens=False)
            == ref(text, add_special_tokens=False)["input_ids"]
        )
