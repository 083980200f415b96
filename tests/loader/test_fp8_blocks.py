"""Block-quantized fp8 checkpoints (DeepSeek-V3's layout: e4m3 codes and a float32 scale per
weight block, `X.weight_scale_inv`) load dequantized: a tiny DeepSeek-V3 written that way
serves the logits and greedy tokens of transformers running the dequantized weights."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelm.loader.fp8_blocks import dequantize, quantize

BLOCK = (16, 16)  # small blocks: the tiny model's 24- and 40-wide weights end in partial ones


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    # as DeepSeek's checkpoints: linears in fp8; embeddings, norms, router and head not
    return (t.dim() == 2 and name.endswith("proj.weight")) or (
        t.dim() == 2 and ".experts." in name)


def _write_fp8_checkpoint(hf, path):
    """Write hf as a block-quantized fp8 checkpoint at path; returns transformers' model of
    the dequantized weights (the reference) and how many weights were quantized."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(hf.config.vocab_size)},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    out = {}
    for name, t in tensors.items():
        if _is_quantized(name, t):
            codes, scale = quantize(t, BLOCK)
            out[name], out[name + "_scale_inv"] = codes, scale
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(cfg))
    # the reference: transformers loading the same checkpoint with every quantized weight
    # replaced by its dequantized copy (the keys as saved: it maps them to its own layout)
    ref_dir = path.parent / (path.name + "-dequantized")
    hf.save_pretrained(ref_dir, safe_serialization=True)
    for file in ref_dir.glob("*.safetensors"):
        file.unlink()
    save_file({n: (dequantize(t, out[n + "_scale_inv"], BLOCK) if n + "_scale_inv" in out else t)
               for n, t in out.items() if not n.endswith("_scale_inv")},
              str(ref_dir / "model.safetensors"))
    ref = type(hf).from_pretrained(ref_dir).eval()
    ref.generation_config.eos_token_id = None
    return ref, sum(1 for n in out if n.endswith("_scale_inv"))


def test_dequantize_round_trip_and_partial_blocks():
    w = torch.randn(40, 24)
    codes, scale = quantize(w, BLOCK)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = dequantize(codes, scale, BLOCK)
    assert (back - w).abs().max() <= w.abs().max() * 2 ** -4  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        dequantize(codes, scale[:2], BLOCK, "x.weight")


def _tiny(family):
    from tiny_families import make_tiny_family_model
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("qwen3") if family == "qwen3" else make_tiny_family_model(family)


# DeepSeek-V3 (read by the all-tensors path) and Qwen3-FP8 (by the named-weights path)
@pytest.mark.parametrize("family,min_quantized", [("deepseek_v3", 20), ("qwen3", 14)])
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, family,
                                                                        min_quantized):
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    hf, num_quantized = _write_fp8_checkpoint(_tiny(family), tmp_path / "fp8")
    assert num_quantized >= min_quantized  # attention and MLP linears (and experts)
    prompt = [5, 17, 99, 3, 250, 11, 42, 8, 130]
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=16, do_sample=False, pad_token_id=0)
    llm = LLM(str(tmp_path / "fp8"), num_blocks=64, block_size=4)
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                              logprobs=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[0, len(prompt):].tolist()
    ref_top = torch.log_softmax(ref_logits.float(), -1).topk(5)
    assert [t for t, _ in out.logprobs[0].top] == ref_top.indices.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in out.logprobs[0].top]),
                               ref_top.values, atol=1e-4, rtol=1e-4)


def test_an_fp8_layout_without_blocks_is_refused(tmp_path):
    from servelm.loader.fp8_blocks import fp8_block_size

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128]}}))
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size(tmp_path)


def test_dequantize_into_bfloat16_rounds_the_float32_product_once():
    w = torch.randn(40, 24)
    codes, scale = quantize(w, BLOCK)  # 40 rows: the last block row partial
    back = dequantize(codes, scale, BLOCK, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, dequantize(codes, scale, BLOCK).to(torch.bfloat16))


def test_a_bfloat16_model_reads_fp8_blocks_into_bfloat16(tmp_path, monkeypatch):
    """The loader dequantizes into the model's dtype: no float32 copy of a matrix on the way
    to a bfloat16 model, and the weights are the float32 dequantization rounded once."""
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.loader import fp8_blocks

    hf, _ = _write_fp8_checkpoint(_tiny("qwen3").to(torch.bfloat16), tmp_path / "fp8")
    made = []
    original = fp8_blocks.dequantize

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        made.append(out.dtype)
        return out

    monkeypatch.setattr(fp8_blocks, "dequantize", spy)
    engine = build_engine(EngineArgs(model=str(tmp_path / "fp8"), num_blocks=16,
                                     block_size=4, dtype="bfloat16"))
    assert len(made) >= 14 and set(made) == {torch.bfloat16}
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    want = original(tensors[name], tensors[name + "_scale_inv"], BLOCK).to(torch.bfloat16)
    o_proj = engine.runner.model.layers[0].self_attn.o_proj
    got = getattr(o_proj, "weight", None)
    if got is None or got.shape != want.shape:  # packed for a bfloat16 GEMM: its values back
        got = o_proj(torch.eye(want.shape[1], dtype=torch.bfloat16)).t()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
