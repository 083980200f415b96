"""Conformance on tiny random-weight models (llama; qwen3 with q/k norms), in float32 and in
bfloat16: with --deterministic, every case's token ids and logprobs are bitwise its
reference's under every perturbation (determinism_harness.py); without it the divergence rate
is reported, not asserted."""

import pytest
import torch

from determinism_harness import (ROW_SLICES, check_invariant_kernels, check_perturbed, diverged,
                                 make_cases, reference, run_scenario, scenarios, write_report)
from servelm.layers.det_linear import cpu_linear_kind, det_linear_calls

needs_bf16 = pytest.mark.skipif(cpu_linear_kind(torch.bfloat16) is None,
                                reason="no bfloat16 GEMM of servelm's runs on this CPU")
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16)]


def _engine_factory(hf, **fixed):
    """make(**kw) -> a tiny engine; make.engines: every engine it made, in order."""
    from tiny_models import make_tiny_engine

    def make(**kw):
        engine = make_tiny_engine(hf, **{**fixed, **kw})
        make.engines.append(engine)
        return engine

    make.engines = []
    return make


def _run_checked(make, cases, sc, vocab: int):
    """run_scenario, then: the scenario perturbed what it claims, and the deterministic
    kernels ran (det_linear calls for float32; for any dtype, the per-row paths and the
    batch-invariant linears)."""
    calls = det_linear_calls()
    got, perturbed = run_scenario(make, cases, sc, vocab)
    check_perturbed(sc, perturbed)
    check_invariant_kernels(make.engines[-1])
    if make.engines[-1].runner.model.embed_tokens.weight.dtype == torch.float32:
        assert det_linear_calls() > calls
    return got


# Llama under every perturbation; Qwen3 (the same stack, plus q/k norms) under those that
# move batch shapes the most; in bfloat16 also decode steps run in slices of rows.
QWEN3_SCENARIOS = ("batch-16", "chunk-7", "prefix-warm", "preemption", "spec-ngram")
PAIRS = [("float32", "llama", sc) for sc in scenarios()] + [
    ("float32", "qwen3", sc) for sc in scenarios() if sc.name in QWEN3_SCENARIOS]
PAIRS += [pytest.param("bfloat16", name, sc, marks=needs_bf16)
          for _, name, sc in PAIRS] + [pytest.param("bfloat16", "llama", ROW_SLICES,
                                                    marks=needs_bf16)]
_families: dict = {}


def _family(name: str, dtype: str):
    """(hf model, cases, deterministic reference) per family and dtype, built once."""
    if (name, dtype) not in _families:
        from tiny_models import make_tiny_hf_model

        hf = make_tiny_hf_model(name)
        cases = make_cases(hf.config.vocab_size, num_greedy=3, num_sampled=3, max_tokens=20)
        make = _engine_factory(hf, deterministic=True, dtype=dtype)
        _families[name, dtype] = hf, cases, reference(make, cases)
    return _families[name, dtype]


def _id(p) -> str:
    dtype, name, sc = p.values if hasattr(p, "values") else p
    return f"{dtype}-{name}-{sc.name}"


@pytest.mark.parametrize("dtype,name,sc", PAIRS, ids=[_id(p) for p in PAIRS])
def test_deterministic_mode_is_bitwise_under_perturbation(dtype, name, sc):
    hf, cases, det_reference = _family(name, dtype)
    got = _run_checked(_engine_factory(hf, deterministic=True, dtype=dtype), cases, sc,
                       hf.config.vocab_size)
    assert diverged(det_reference, got) == {"tokens": [], "logprobs": []}
    for case, out in got.items():
        assert len(out.token_ids) == 20, case
        if "nolp" not in case:
            assert len(out.logprobs) == 20, case


@pytest.mark.slow
def test_default_mode_divergence_is_reported():
    """The same suite without --deterministic (tiny llama): how often a perturbation moves a
    case's tokens or logprobs (reported, not asserted; the numbers go in docs/determinism.md)."""
    from tiny_models import make_tiny_hf_model

    name, hf = "llama", make_tiny_hf_model("llama")
    cases = make_cases(hf.config.vocab_size, num_greedy=3, num_sampled=3, max_tokens=20)
    make = _engine_factory(hf)
    ref = reference(make, cases)
    rows, moved_tokens, moved_logprobs, total = {}, 0, 0, 0
    for sc in scenarios():
        got, _ = run_scenario(make, cases, sc, hf.config.vocab_size)
        d = diverged(ref, got)
        rows[sc.name] = d
        moved_tokens += len(d["tokens"])
        moved_logprobs += len(d["logprobs"])
        total += len(cases)
    write_report(f"tiny-{name}", {"model": f"tiny-{name}", "scenarios": rows, "summary": {
        "case_runs": total, "token_divergence_rate": moved_tokens / total,
        "logprob_divergence_rate": moved_logprobs / total}})


EAGER_SCENARIOS = ("batch-16", "chunk-7", "prefix-warm", "preemption")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_family_on_the_eager_path_is_bitwise_too(dtype):
    """Phi-3 (models/decoder.py) with the C++ stack off (`--cpu-kernels decode=torch`: the
    eager model with batch-invariant linears and per-row attention), under a subset of the
    perturbations. (Its fast path would take the stack: the families the stack refuses have
    windows, soft-caps or experts, which --deterministic refuses too.)"""
    from tiny_families import make_tiny_family_model

    hf = make_tiny_family_model("phi3", sliding_window=None)
    cases = make_cases(hf.config.vocab_size, num_greedy=2, num_sampled=2, max_tokens=12)
    make = _engine_factory(hf, deterministic=True, dtype=dtype, cpu_kernels="decode=torch")
    assert make().runner.cpu_stack is None  # the eager path
    ref = reference(make, cases)
    for sc in scenarios():
        if sc.name in EAGER_SCENARIOS:
            got = _run_checked(make, cases, sc, hf.config.vocab_size)
            assert diverged(ref, got) == {"tokens": [], "logprobs": []}, sc.name


def test_mixture_of_experts_is_refused(tiny_engine):
    from tiny_families import make_tiny_family_model

    with pytest.raises(ValueError, match="mixture-of-experts"):
        tiny_engine(make_tiny_family_model("mixtral"), deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_fp8_kv_cache_is_bitwise_too(dtype):
    """e4m3 KV codes (--kv-cache-dtype fp8): stored per row, read by the same row kernel."""
    from tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    cases = make_cases(hf.config.vocab_size, num_greedy=2, num_sampled=2, max_tokens=12)
    make = _engine_factory(hf, deterministic=True, kv_cache_dtype="fp8", dtype=dtype)
    assert make().runner.kv_cache.is_fp8
    ref = reference(make, cases)
    for sc in scenarios():
        if sc.name in ("batch-16", "chunk-7", "preemption"):
            got = _run_checked(make, cases, sc, hf.config.vocab_size)
            assert diverged(ref, got) == {"tokens": [], "logprobs": []}, sc.name
