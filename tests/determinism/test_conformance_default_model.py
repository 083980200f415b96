"""Conformance on the default model (SmolLM2-135M-Instruct from its GGUF), in float32 and in
bfloat16 (what `--dtype auto` picks where the CPU runs bfloat16 dot products): with
--deterministic each case's tokens and logprobs are bitwise its reference's under batching,
chunking, a warm prefix cache, preemption and n-gram speculation, in process and through the
engine core process; without it the divergence rate is reported."""

import asyncio
import random

import pytest
import torch

from determinism_harness import (ROW_SLICES, Output, Scenario, check_invariant_kernels,
                                 check_perturbed, diverged, fillers, make_cases, reference,
                                 run_scenario, write_report)
from servelm.config import EngineArgs
from servelm.layers.det_linear import cpu_linear_kind, det_linear_calls
from servelm.protocol import EngineRequest

MAX_TOKENS = 16
SCENARIOS = [
    Scenario("batch-16", {}, num_others=12, spread=6),
    Scenario("chunk-random", {"max_num_batched_tokens": random.Random(2).randint(17, 90)},
             num_others=6, spread=4),
    Scenario("prefix-warm", {}, num_others=6, share_prefix=True, warm=True),
    Scenario("preemption", {"num_blocks": 12}, num_others=6, spread=3),
    Scenario("spec-ngram", {"speculative_method": "ngram", "num_speculative_tokens": 4,
                            "spec_adaptive": False}, num_others=4, spread=3),
    Scenario("one-thread", {}, num_others=4, spread=3, threads=1),
]
REPORTED = ("batch-16", "prefix-warm")  # the default-mode report's scenarios (CI time)
needs_bf16 = pytest.mark.skipif(cpu_linear_kind(torch.bfloat16) is None,
                                reason="no bfloat16 GEMM of servelm's runs on this CPU")


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=needs_bf16)])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def model_path(default_model_path):
    return str(default_model_path)


@pytest.fixture(scope="module")
def loaded(model_path):
    """The default model's config and float weights, read once for every engine here."""
    from servelm.loader import iter_weights, load_model_config, load_tokenizer, resolve_model

    source = resolve_model(model_path)
    config = load_model_config(source)
    weights = list(iter_weights(source, config))
    return config, weights, load_tokenizer(source)


def _factory(loaded, **fixed):
    """make(**kw) -> an engine on the default model; make.engines: every one it made."""
    from servelm.engine_builder import assemble_engine

    config, weights, tokenizer = loaded

    def make(**kw):
        args = EngineArgs(model="default", **{"kv_cache_memory": 256 * 2**20, **fixed, **kw})
        engine = assemble_engine(args, config, iter(weights), tokenizer, "default")
        make.engines.append(engine)
        return engine

    make.engines = []
    return make


@pytest.fixture(scope="module")
def cases(loaded):
    return make_cases(loaded[0].vocab_size, num_greedy=2, num_sampled=2, max_tokens=MAX_TOKENS,
                      seed=3)


@pytest.fixture(scope="module")
def det_reference(loaded, cases, dtype):
    return reference(_factory(loaded, deterministic=True, dtype=dtype), cases)


@pytest.mark.slow
@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_default_model_deterministic_under_perturbation(loaded, cases, dtype, det_reference,
                                                        sc):
    _check_scenario(loaded, cases, dtype, det_reference, sc)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16)], indirect=True)
def test_default_model_bf16_decode_steps_in_slices_of_rows(loaded, cases, dtype,
                                                           det_reference):
    _check_scenario(loaded, cases, dtype, det_reference, ROW_SLICES)


def _check_scenario(loaded, cases, dtype, det_reference, sc) -> None:
    calls = det_linear_calls()
    make = _factory(loaded, deterministic=True, dtype=dtype)
    got, perturbed = run_scenario(make, cases, sc, loaded[0].vocab_size)
    check_invariant_kernels(make.engines[-1])
    if dtype == "float32":
        assert det_linear_calls() > calls
    check_perturbed(sc, perturbed)
    assert diverged(det_reference, got) == {"tokens": [], "logprobs": []}


async def _through_core(args: EngineArgs, tokenizer, cases, others) -> dict[str, Output]:
    """Every case and other request submitted at once to an engine core process (they
    batch there); the cases' outputs."""
    from servelm.core_process.client import CoreClient

    client = CoreClient.spawn(args, tokenizer)
    client.start(asyncio.get_running_loop())
    try:
        requests = [EngineRequest(c.name, list(c.prompt), c.params) for c in cases]
        requests += [EngineRequest(f"other{i}", p, sp) for i, (p, sp) in enumerate(others)]
        random.Random(0).shuffle(requests)
        streams = [client.submit([r]) for r in requests]
        outputs = {r.request_id: Output() for r in requests}

        async def drain(stream):
            while True:
                deltas = await stream.get()
                if not deltas:
                    return
                for d in deltas:
                    assert d.error is None, d.error
                    outputs[d.request_id].token_ids += d.token_ids
                    for lp in d.logprobs or []:
                        outputs[d.request_id].logprobs.append(
                            (lp.token_id, lp.logprob, tuple(lp.top)))

        await asyncio.gather(*(drain(s) for s in streams))
    finally:
        client.stop()
    return {c.name: outputs[c.name] for c in cases}


@pytest.mark.slow
def test_default_model_deterministic_through_the_engine_core_process(model_path, loaded, cases,
                                                                    dtype, det_reference):
    from servelm import dtype_choice
    from servelm.loader import resolve_model

    # --dtype auto where it picks this dtype: deterministic mode runs the default's dtype
    auto, _ = dtype_choice.resolve("auto", "cpu", resolve_model(model_path))
    args = EngineArgs(model=model_path, deterministic=True, kv_cache_memory=256 * 2**20,
                      max_num_batched_tokens=64, dtype="auto" if auto == dtype else dtype)
    others = fillers(cases, loaded[0].vocab_size, 8, seed=5)
    got = asyncio.run(_through_core(args, loaded[2], cases, others))
    assert diverged(det_reference, got) == {"tokens": [], "logprobs": []}


@pytest.mark.slow
def test_default_model_divergence_without_deterministic_is_reported(loaded, cases, dtype):
    make = _factory(loaded, dtype=dtype)
    ref = reference(make, cases)
    rows, tokens, logprobs = {}, 0, 0
    scs = [sc for sc in SCENARIOS if sc.name in REPORTED]
    for sc in scs:
        got, _ = run_scenario(make, cases, sc, loaded[0].vocab_size)
        rows[sc.name] = diverged(ref, got)
        tokens += len(rows[sc.name]["tokens"])
        logprobs += len(rows[sc.name]["logprobs"])
    total = len(cases) * len(scs)
    summary = {"case_runs": total, "token_divergence_rate": tokens / total,
               "logprob_divergence_rate": logprobs / total}
    write_report(f"default-model-{dtype}", {"model": f"SmolLM2-135M-Instruct (GGUF, {dtype})",
                                            "scenarios": rows, "summary": summary})
