"""HF directory loading: tiny random Llama / Qwen2 / Qwen3 checkpoints saved by transformers."""

import json

import pytest
import torch

from servelm.loader import iter_weights, load_model_config, load_tokenizer, resolve_model
from servelm.loader.hf_loader import hf_weight_names
from tiny_models import make_tiny_hf_model

TINY = dict(
    vocab_size=49152,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _llama():
    return make_tiny_hf_model("llama", **TINY, rope_theta=50000.0, rms_norm_eps=1e-5,
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _qwen2():
    return make_tiny_hf_model("qwen2", **TINY, tie_word_embeddings=True, eos_token_id=[2, 0])


def _qwen3():
    # head_dim deliberately != hidden / heads, as in real Qwen3 models.
    return make_tiny_hf_model("qwen3", **TINY, head_dim=16, tie_word_embeddings=False)


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}


@pytest.fixture(params=sorted(BUILDERS))
def saved_model(request, tmp_path):
    torch.manual_seed(0)
    model = BUILDERS[request.param]()
    for p in model.parameters():  # norms start at 1 and biases at 0; make every value distinct
        torch.nn.init.normal_(p.data)
    out = tmp_path / f"tiny-{request.param}"
    model.save_pretrained(out)
    return request.param, model, out


def test_config_round_trip(saved_model):
    family, model, path = saved_model
    source = resolve_model(str(path))
    assert source.kind == "hf" and source.name == path.name
    c = load_model_config(source)
    hf = model.config
    assert c.architecture == family
    assert c.name == path.name
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (2, 32, 48)
    assert (c.num_heads, c.num_kv_heads, c.vocab_size) == (4, 2, 49152)
    assert c.head_dim == (16 if family == "qwen3" else 8)
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.attention_bias == (family == "qwen2")
    assert c.qk_norm == (family == "qwen3")
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    if family == "llama":
        assert c.rope_theta == 50000.0
        assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    if family == "qwen2":
        assert c.eos_token_ids == (2, 0)


def test_weights_round_trip(saved_model):
    family, model, path = saved_model
    source = resolve_model(str(path))
    config = load_model_config(source)
    ours = dict(iter_weights(source, config))
    expected = model.state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(expected) == sorted(hf_weight_names(config))
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
    if family == "qwen2":
        assert "model.layers.1.self_attn.v_proj.bias" in ours
    if family == "qwen3":
        assert ours["model.layers.0.self_attn.q_norm.weight"].shape == (16,)


def test_bf16_checkpoint_is_cast_to_float32(tmp_path):
    model = _llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    source = resolve_model(str(tmp_path / "bf16"))
    weights = dict(iter_weights(source, load_model_config(source)))
    w = weights["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, model.state_dict()["model.layers.0.mlp.up_proj.weight"].float())


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _llama()
    model.save_pretrained(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    source = resolve_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="gate_proj"):
        list(iter_weights(source, load_model_config(source)))


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, reference_tokenizer):
    """The GGUF-converted tokenizer saved as a HF folder (tokenizer.json + config files)."""
    out = tmp_path_factory.mktemp("tok")
    reference_tokenizer.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({**TINY, "model_type": "llama", "eos_token_id": 2}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return out


def test_hf_tokenizer_matches_transformers(hf_tokenizer_dir, reference_tokenizer):
    tok = load_tokenizer(resolve_model(str(hf_tokenizer_dir)))
    for text in ["Hello world", "I'm  here\n\n数学 😀 12345", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == reference_tokenizer(text)["input_ids"]
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    # tokenizer eos, generation_config's extra id, then end-of-generation tokens by name.
    assert tok.eos_token_ids == (2, 5, 0)
    assert tok.chat_template == reference_tokenizer.chat_template
    assert tok.is_special(0) and not tok.is_special(100)


def test_hf_tokenizer_inline_chat_template_list(hf_tokenizer_dir, tmp_path):
    import shutil

    d = tmp_path / "inline"
    shutil.copytree(hf_tokenizer_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(resolve_model(str(d))).chat_template == "D"
