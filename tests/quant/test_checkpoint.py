"""`servelm quantize` checkpoints: written once, loaded as they are.

A checkpoint loaded from disk must give the same logits, bit for bit, as quantizing the source
at load time, and loading it must not quantize anything (the quantizers are made to raise).
"""

import json

import pytest
import torch
from safetensors import safe_open

from tiny_models import prefill_logits
from servelm.cli import main as cli_main
from servelm.config import EngineArgs
from servelm.engine_builder import build_engine
from servelm.protocol import InvalidParameterError
from servelm.quant import methods
from servelm.quant_tools.quantize import quantize_checkpoint
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_head import Int8Head
from servelm.quant.int8_linear import Int8Linear
from servelm.quant.quantized_weight import QuantizedWeight, pack_int4, unpack_int4

PROMPT = [5, 17, 99, 3, 250, 11, 42, 8, 8, 301, 77, 2]


def _tiny_dir(path, hf_model):
    """A tiny HF model directory with a word-level tokenizer over its 384 ids."""
    import tokenizers

    hf_model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(hf_model.config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def _engine(model, **kw):
    return build_engine(EngineArgs(model=str(model), num_blocks=64, block_size=4, **kw))


def _score(engine, prompt=PROMPT):
    return prefill_logits(engine, prompt)


@pytest.mark.parametrize("arch,method,tied", [("llama", "int8", False),
                                              ("llama", "int4-g32", True),
                                              ("qwen2", "int4-g64", False),  # q/k/v biases
                                              ("qwen3", "int4-g128", False)])  # q/k norms
def test_checkpoint_loads_to_the_same_logits_as_load_time_quantization(
        arch, method, tied, tiny_hf, tmp_path, monkeypatch):
    src = _tiny_dir(tmp_path / "src", tiny_hf(arch, tie_word_embeddings=tied))
    at_load = _engine(src, quantization=method)
    out = tmp_path / "q"
    summary = quantize_checkpoint(str(src), method, out)
    assert summary.method == method and sum(summary.formats.values()) > 0

    def refuse(*args, **kwargs):
        raise AssertionError("a pre-quantized checkpoint was quantized again at load time")

    monkeypatch.setattr(methods, "quantize_int8_per_channel", refuse)
    monkeypatch.setattr(methods, "quantize_int4_groups", refuse)
    loaded = _engine(out)  # no --quantization: the metadata names the method
    model = loaded.runner.model
    kind = Int8Linear if method == "int8" else Int4Linear
    assert type(model.layers[0].self_attn.qkv_proj) is kind
    assert type(model.layers[1].mlp.gate_up_proj) is kind
    assert isinstance(model.lm_head, Int8Head)
    if kind is Int4Linear:
        assert model.layers[0].mlp.down_proj.group_size == int(method.split("-g")[1])
    a, b = _score(at_load), _score(loaded)
    assert torch.equal(a, b), (a - b).abs().max()
    # and the same when the method is repeated explicitly
    assert torch.equal(_score(_engine(out, quantization=method)), a)


def test_checkpoint_metadata(tiny_hf, tmp_path):
    src = _tiny_dir(tmp_path / "src", tiny_hf("llama", tie_word_embeddings=True))
    out = tmp_path / "q"
    assert cli_main(["quantize", str(src), "--method", "int4-g32", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    import servelm

    assert qc["quant_method"] == "servelm" and qc["method"] == "int4-g32"
    assert qc["group_size"] == 32 and qc["servelm_version"] == servelm.__version__
    assert qc["formats"] == ["int4-g32", "int8"]  # layers int4, the head int8
    assert qc["lm_head"] == "int8" and qc["tied_lm_head"] is True
    assert cfg["tie_word_embeddings"] is False  # the head is its own tensor now
    assert (out / "tokenizer.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["servelm_quantization"])
        assert header["method"] == "int4-g32"
        assert header["formats"]["model.layers.0.self_attn.k_proj"] == "int4-g32"
        assert header["formats"]["lm_head"] == "int8"
        # k_proj: 2 kv heads x 16 = 32 rows, 64 columns -> 32 packed bytes, 2 groups
        q = f.get_tensor("model.layers.0.self_attn.k_proj.qweight")
        assert q.dtype == torch.uint8 and q.shape == (32, 32)
        assert f.get_tensor("model.layers.0.self_attn.k_proj.scales").shape == (32, 2)
        assert f.get_tensor("model.layers.0.self_attn.k_proj.zeros").dtype == torch.bfloat16
        assert f.get_tensor("lm_head.qweight").dtype == torch.int8
        assert "model.layers.0.self_attn.k_proj.weight" not in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").shape == (384, 64)


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and torch.equal(unpack_int4(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)


def test_quantized_weight_dequantize_matches_int4_layer():
    w = torch.randn(48, 80)
    qw = methods.Int4Method("int4-g32", 32, torch.float32).quantize(w)
    layer = methods.Int4Method("int4-g32", 32, torch.float32).build(qw, None)
    assert torch.allclose(qw.dequantize(), layer.dequantize(), atol=1e-6)
    assert isinstance(qw, QuantizedWeight) and qw.rows(8, 8).shape == (8, 80)


def test_quantization_mismatch_is_a_clear_error(tiny_hf, tmp_path):
    src = _tiny_dir(tmp_path / "src", tiny_hf("llama"))
    quantize_checkpoint(str(src), "int8", tmp_path / "q")
    with pytest.raises(InvalidParameterError, match="pre-quantized with 'int8'") as e:
        _engine(tmp_path / "q", quantization="int4-g32")
    assert e.value.param == "quantization"


def test_bad_quantize_arguments_name_the_parameter(tiny_hf, tmp_path, capsys):
    src = _tiny_dir(tmp_path / "src", tiny_hf("llama"))
    with pytest.raises(InvalidParameterError, match="method 'fp3'") as e:
        quantize_checkpoint(str(src), "fp3", tmp_path / "a")
    assert e.value.param == "method"
    with pytest.raises(SystemExit):
        cli_main(["quantize", str(src), "--method", "fp3", "--out", str(tmp_path / "a")])
    assert "--method" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError, match="keeps a GGUF file's blocks") as e:
        quantize_checkpoint(str(src), "gguf", tmp_path / "b")
    assert e.value.param == "method"
    quantize_checkpoint(str(src), "int8", tmp_path / "c")
    with pytest.raises(InvalidParameterError, match="not empty") as e:
        quantize_checkpoint(str(src), "int8", tmp_path / "c")
    assert e.value.param == "out"
    with pytest.raises(InvalidParameterError, match="already a quantized") as e:
        quantize_checkpoint(str(tmp_path / "c"), "int8", tmp_path / "d")
    assert e.value.param == "model"


def test_foreign_quantization_config_is_refused(tiny_hf, tmp_path):
    src = _tiny_dir(tmp_path / "src", tiny_hf("llama"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidParameterError, match="quantized with 'bitsandbytes'") as e:
        _engine(src)
    assert e.value.param == "model"


def test_checkpoint_with_mismatched_header_is_refused(tiny_hf, tmp_path):
    src = _tiny_dir(tmp_path / "src", tiny_hf("llama"))
    out = tmp_path / "q"
    quantize_checkpoint(str(src), "int8", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["method"] = "int4-g32"  # config.json edited by hand
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not belong together"):
        _engine(out)


def test_default_model_gguf_checkpoint(default_model_path, tmp_path, monkeypatch):
    """The default GGUF's Q4_1 codes written out and served from the directory: the same
    logits as `--quantization gguf` on the file (so the same greedy text), the same
    tokenizer."""
    from servelm.llm import LLM

    out = tmp_path / "smollm2-gguf"
    quantize_checkpoint("smollm2-135m-instruct", "gguf", out)
    kw = dict(kv_cache_memory=16 * 2**20, max_model_len=256)
    ref = LLM("smollm2-135m-instruct", quantization="gguf", **kw)
    monkeypatch.setattr(methods, "quantize_int4_groups", None)  # must not be called
    llm = LLM(str(out), **kw)
    assert isinstance(llm.engine.runner.model.layers[0].mlp.gate_up_proj, Int4Linear)
    text = "The quick brown fox jumps over the lazy dog. 12345 <|im_end|> naïve café"
    ids = ref.engine.tokenizer.encode(text)
    assert llm.engine.tokenizer.encode(text) == ids
    assert set(llm.engine.eos_token_ids) == set(ref.engine.eos_token_ids)
    assert llm.engine.tokenizer.chat_template == ref.engine.tokenizer.chat_template
    assert torch.equal(_score(llm.engine, ids), _score(ref.engine, ids))
