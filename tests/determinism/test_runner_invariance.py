"""Deterministic mode at the runner: a prompt's logits at every position are the same bits
scored whole, in chunks over its cached context, beside another prompt, and through either
forward path (the C++ stack or the eager model), in float32 and in bfloat16: prefill and
decode share one per-row algorithm. And configurations it cannot make invariant are refused
by name."""

import pytest
import torch

from servelm.core.runner_state import score_item
from servelm.layers.det_linear import cpu_linear_kind
from servelm.engine.sequence import Sequence
from servelm.protocol import RequestTimings, SamplingParams


def _score(engine, spans):
    """spans: (prompt, [chunk lengths]) per sequence; the chunks of all sequences are scored
    round by round, every sequence's chunk of a round in one batch -> logits per sequence."""
    seqs = []
    for i, (prompt, _) in enumerate(spans):
        seq = Sequence(f"s{i}", i, prompt, SamplingParams(max_tokens=1), RequestTimings(), 1)
        engine.block_manager.allocate(seq, len(prompt))
        seqs.append(seq)
    out = [[] for _ in spans]
    starts = [0] * len(spans)
    try:
        for r in range(max(len(cuts) for _, cuts in spans)):
            items, owners = [], []
            for i, (prompt, cuts) in enumerate(spans):
                if r < len(cuts):
                    items.append(score_item(prompt, seqs[i].block_table, starts[i], cuts[r]))
                    owners.append((i, cuts[r]))
                    starts[i] += cuts[r]
            items_sorted = sorted(zip(items, owners), key=lambda x: x[1][1] != 1)
            logits = engine.runner.score([it for it, _ in items_sorted])
            at = 0
            for _, (i, n) in items_sorted:
                out[i].append(logits[at:at + n])
                at += n
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)
    return [torch.cat(x) for x in out]


needs_bf16 = pytest.mark.skipif(cpu_linear_kind(torch.bfloat16) is None,
                                reason="no bfloat16 GEMM of servelm's runs on this CPU")
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16)]


@pytest.fixture(scope="module")
def hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("qwen2")


PROMPT = [(7 * i + 3) % 384 for i in range(41)]
OTHER = [(11 * i + 5) % 384 for i in range(29)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cpu_kernels", ["auto", "decode=torch"])
def test_logits_are_the_same_bits_however_a_prompt_is_computed(hf, tiny_engine, cpu_kernels,
                                                                dtype):
    engine = tiny_engine(hf, deterministic=True, cpu_kernels=cpu_kernels, dtype=dtype)
    (whole,) = _score(engine, [(PROMPT, [41])])
    chunked, _ = _score(engine, [(PROMPT, [6, 1, 1, 13, 20]), (OTHER, [29])])
    _, beside = _score(engine, [(OTHER, [3, 26]), (PROMPT, [1] * 41)])
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, beside)
    stack = engine.runner.cpu_stack
    assert (stack is not None and stack.steps > 0) == (cpu_kernels == "auto")
    if cpu_kernels != "auto":
        assert engine.runner.backend.deterministic_steps > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stack_and_the_eager_model_agree_bitwise(hf, tiny_engine, dtype):
    runs = [_score(tiny_engine(hf, deterministic=True, cpu_kernels=c, dtype=dtype),
                   [(PROMPT, [17, 24])])[0] for c in ("auto", "decode=torch")]
    assert torch.equal(*runs)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), pytest.param("bfloat16", 0.1,
                                                                      marks=needs_bf16)])
def test_deterministic_logits_are_the_models(hf, tiny_engine, dtype, tol):
    (det,) = _score(tiny_engine(hf, deterministic=True, dtype=dtype), [(PROMPT, [41])])
    (default,) = _score(tiny_engine(hf, dtype=dtype), [(PROMPT, [41])])
    assert det.dtype == torch.float32  # a bfloat16 head's float32 sums
    torch.testing.assert_close(det, default.float(), rtol=tol, atol=tol)
    if dtype == "bfloat16":  # the model's bfloat16 arithmetic, not float32's
        (wide,) = _score(tiny_engine(hf, deterministic=True), [(PROMPT, [41])])
        assert not torch.equal(det, wide)
        torch.testing.assert_close(det, wide, rtol=tol, atol=tol)


@needs_bf16
def test_bf16_takes_the_models_dtype_and_servelms_gemm_at_every_row_count(hf, tiny_engine):
    """No oneDNN (it blocks by the row count) and no MixedLinear (its form changes with the
    step's rows): every linear one batch-invariant kernel, the head's logits float32."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.dot_linear import DotLinear

    engine = tiny_engine(hf, deterministic=True, dtype="bfloat16")
    model = engine.runner.model
    assert engine.runner.kv_cache.k.dtype == torch.bfloat16
    kind = {"dot": DotLinear, "amx": AmxLinear}[cpu_linear_kind(torch.bfloat16)]
    layers = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert len(layers) == 2 * 4 + 1
    assert all(type(m) is kind for m in layers if m is not model.lm_head)
    assert type(model.lm_head) is DotLinear and model.lm_head.op == "dot_linear_float"


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "float16"}, "float16 is not covered"),
    ({"quantization": "int8"}, "quantized"),
    ({"cpu_kernels": "torch"}, "C\\+\\+ CPU kernels|paged attention kernel"),
])
def test_what_cannot_be_made_invariant_is_refused(hf, tiny_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine(hf, deterministic=True, **kwargs)


def test_bf16_without_servelms_bf16_gemm_is_refused(hf, tiny_engine, monkeypatch):
    from servelm.layers import amx_linear, dot_linear

    monkeypatch.setattr(amx_linear, "amx_usable", lambda: False)
    monkeypatch.setattr(dot_linear, "dot_usable", lambda: False)
    with pytest.raises(ValueError, match="bfloat16 needs servelm's bfloat16 GEMM.*float32"):
        tiny_engine(hf, deterministic=True, dtype="bfloat16")


def test_attention_variants_are_refused(tiny_engine):
    from tiny_families import make_tiny_family_model

    with pytest.raises(ValueError, match="sliding-window and soft-capped"):
        tiny_engine(make_tiny_family_model("gemma2"), deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_start_up_log_says_deterministic_paths_ran(hf, tiny_engine, caplog, dtype):
    import logging

    with caplog.at_level(logging.INFO, logger="servelm.engine_builder"):
        tiny_engine(hf, deterministic=True, dtype=dtype)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels")]
    gemm = cpu_linear_kind(getattr(torch, dtype))
    assert lines and lines[0].endswith("attention=rows decode=stack layer_ops=fused quant=none "
                                       f"gemm={gemm}")


def test_the_flag_is_in_help_and_reaches_engine_args():
    import argparse

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    assert "--deterministic" in parser.format_help()
    args = parser.parse_args(["--deterministic"])
    assert engine_args_from_cli(argparse.Namespace(model="m", **vars(args))).deterministic
