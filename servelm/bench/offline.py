"""Offline throughput and latency of servelm through its Python API (`LLM.generate`).

Owns: run_offline (one timed generate over a workload) and result_from_outputs (the
RequestOutputs -> result arithmetic, shared with the tests).
Never: changes engine settings it was not given; runs a peer (peers.py does, in its own venv).
The result schema lives in results.py so peer scripts can produce it without servelm.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any, Sequence

from servelm.bench.results import MemorySampler, RequestTiming, build_result
from servelm.bench.workloads import Request, random_lengths

WARMUP_SEED_OFFSET = 10_000  # same warm-up request as peers.py


def warmup_requests(vocab_size: int, seed: int) -> list[Request]:
    return random_lengths(1, (16, 16), (8, 8), vocab_size, seed + WARMUP_SEED_OFFSET)


def _sampling_params(requests: Sequence[Request]):
    from servelm import SamplingParams

    def one(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    lengths = {r.max_tokens for r in requests}
    if len(lengths) == 1:
        return one(lengths.pop())
    return [one(r.max_tokens) for r in requests]  # one per prompt, as in vLLM


def _generate(llm, requests: Sequence[Request], progress: bool):
    prompts = [list(r.prompt_token_ids) for r in requests]
    return llm.generate(prompts, _sampling_params(requests), use_tqdm=progress)


def timings_from_outputs(outputs: Sequence[Any], t0: float) -> list[RequestTiming]:
    """Per-request timings from servelm RequestOutputs; every request arrives at t0 (the
    moment generate was called), as in the peer scripts."""
    timings = []
    for out in outputs:
        t = out.timings
        timings.append(RequestTiming(
            num_input_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(out.outputs[0].token_ids),
            arrival_time=t0, first_token_time=t.first_token_time,
            last_token_time=t.last_token_time, finish_time=t.finish_time))
    return timings


def result_from_outputs(outputs: Sequence[Any], t0: float, elapsed_s: float, *, model: str,
                        requests: Sequence[Request], peak_memory_bytes: int | None,
                        command: str | list[str] | None = None, threads: int | None = None,
                        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    timings = timings_from_outputs(outputs, t0)
    extra = dict(extra or {})
    expected = sum(r.max_tokens for r in requests)
    produced = sum(t.num_output_tokens for t in timings)
    if produced != expected:
        extra["warning"] = f"generated {produced} output tokens, expected {expected}"
    preemptions = sum(getattr(o.timings, "num_preemptions", 0) or 0 for o in outputs)
    extra.setdefault("num_preemptions", preemptions)
    return build_result(system="servelm", model=model, timings=timings, elapsed_s=elapsed_s,
                        peak_memory_bytes=peak_memory_bytes, command=command, threads=threads,
                        extra=extra)


def model_dtype(llm) -> str | None:
    """The float type the loaded model computes in: what `--dtype auto` resolved to (the
    first floating-point parameter; a quantized layer's codes are integers)."""
    model = getattr(getattr(llm.engine, "runner", None), "model", None)
    if model is None:
        return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def run_offline(model: str, workload: Sequence[Request],
                engine_kwargs: dict[str, Any] | None = None, *, threads: int | None = None,
                seed: int = 0, vocab_size: int | None = None, progress: bool = True,
                warmup: bool = True, command: str | list[str] | None = None) -> dict[str, Any]:
    """Load `model`, generate `workload` once (greedy, exactly max_tokens each) and return
    the result dict. Model loading and one small warm-up request are outside the clock.
    vocab_size: the warm-up's (the peers' warm-up is drawn the same); None: the model's."""
    import torch

    from servelm import LLM

    if threads:
        torch.set_num_threads(threads)
    engine_kwargs = {k: v for k, v in (engine_kwargs or {}).items() if v is not None}
    with MemorySampler() as mem:
        llm = LLM(model, **engine_kwargs)
        if warmup:
            _generate(llm, warmup_requests(vocab_size or llm.engine.vocab_size, seed),
                      progress=False)
        stats = llm.engine.stats
        computed_before = stats.num_computed_prompt_tokens
        t0 = time.monotonic()
        outputs = _generate(llm, workload, progress)
        elapsed = time.monotonic() - t0
        num_prefill_computed = stats.num_computed_prompt_tokens - computed_before
    result = result_from_outputs(
        outputs, t0, elapsed, model=model, requests=workload,
        peak_memory_bytes=mem.peak_bytes, command=command or sys.argv,
        threads=torch.get_num_threads(),
        extra={"settings": {**engine_kwargs, "torch_threads": torch.get_num_threads(),
                            "model_dtype": model_dtype(llm)},
               # prompt tokens the model actually ran (prefix-cache hits are not run)
               "num_prefill_tokens_computed": num_prefill_computed,
               "num_prefix_cache_hit_tokens": sum(o.timings.num_cached_tokens
                                                  for o in outputs)})
    del llm, outputs
    gc.collect()
    return result
