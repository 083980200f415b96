"""Perplexity: the engine's number against transformers' loss on a tiny model, and the
default model per quantization method on the shipped held-out text."""

import math

import pytest
import torch

from servelm.evals import HELDOUT_TEXT
from servelm.evals.perplexity import perplexity, perplexity_of_ids


def test_perplexity_matches_transformers_loss(tiny_hf, tiny_engine):
    hf = tiny_hf("llama")
    engine = tiny_engine(hf)
    ids = torch.randint(0, 384, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    r = perplexity_of_ids(engine, ids, window=64)  # windows of 64, 64, 22 tokens
    assert r.num_windows == 3 and r.num_tokens == 63 + 63 + 21
    nll = 0.0
    with torch.no_grad():
        for start in range(0, 150, 64):
            chunk = torch.tensor([ids[start:start + 64]])
            loss = hf(chunk, labels=chunk).loss.item()  # mean over len - 1 predictions
            nll += loss * (chunk.shape[1] - 1)
    assert r.nll == pytest.approx(nll / r.num_tokens, rel=1e-4)
    assert r.perplexity == pytest.approx(math.exp(r.nll))


def test_perplexity_arguments_are_checked(tiny_hf, tiny_engine):
    engine = tiny_engine(tiny_hf("llama"), max_model_len=128)
    with pytest.raises(ValueError, match="window 512 exceeds"):
        perplexity_of_ids(engine, [1, 2, 3], window=512)
    with pytest.raises(ValueError, match="window must be at least 2"):
        perplexity_of_ids(engine, [1, 2, 3], window=1)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        perplexity_of_ids(engine, [1], window=16)
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        perplexity(engine, "no tokenizer here")


# Perplexity of the default model on data/heldout_en.txt (2,869 tokens, windows of 1024),
# relative to float32 (the Q4_1 file dequantized). Measured (docs/quantization.md, Quality;
# benchmarks/results/quality-20261130T032456Z.json): float32 25.887, gguf +0.002%, int8
# -0.06%, int4-g32 -0.03%, int4-g128 +84.6%. The bounds leave room for rounding that depends
# on the thread count, not for a regression.
# int8 and int4-g128 (measured the same way by `servelm eval quality`) are left out here to
# keep the suite's time: each method is a model load and ~3k tokens of prefill.
PPL_BOUNDS = {"gguf": (-0.005, 0.005), "int4-g32": (-0.01, 0.015)}


@pytest.mark.slow
def test_default_model_perplexity_per_method(default_model_path):
    from servelm.llm import LLM

    text = HELDOUT_TEXT.read_text()
    ppl = {}
    for method in (None, *PPL_BOUNDS):
        llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 * 2**20, max_model_len=1024,
                  quantization=method)
        r = perplexity(llm.engine, text, window=1024)
        assert r.num_tokens >= 2500 and r.num_windows == 3
        ppl[method or "float32"] = r.perplexity
        del llm
    print("perplexity:", {k: round(v, 3) for k, v in ppl.items()})
    assert 3 < ppl["float32"] < 30, ppl  # the model reads this English text reasonably
    for method, (lo, hi) in PPL_BOUNDS.items():
        assert lo <= ppl[method] / ppl["float32"] - 1 <= hi, (method, ppl)


def test_eval_perplexity_command(tiny_hf, tmp_path, capsys):
    """`servelm eval perplexity` on a tiny HF directory with a word-level tokenizer."""
    import json

    import tokenizers

    from servelm.cli import main
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    model_dir = tmp_path / "tiny"
    tiny_hf("llama").save_pretrained(model_dir)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(384)},
                                                           unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    ids = torch.randint(0, 384, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in ids))
    assert main(["eval", "perplexity", str(model_dir), "--text", str(text), "--window", "40",
                 "--kv-cache-memory", "1MiB", "--quantization", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    engine = build_engine(EngineArgs(model=str(model_dir), kv_cache_memory=2**20,
                                     quantization="int8"))
    r = perplexity_of_ids(engine, ids, window=40)
    assert out["num_tokens"] == r.num_tokens == 97 and out["quantization"] == "int8"
    assert out["perplexity"] == pytest.approx(r.perplexity, rel=1e-6)
