"""fp8 (e4m3) KV cache: the pool holds 2x (bf16) / 4x (fp32) the tokens from the same bytes,
a tiny model's logits stay close to the float cache's, and greedy output is unchanged by
batching, preemption and prefix-cache hits (the fp8 cache is deterministic: a fresh prompt
attends the codes it stored, like every later reader).
"""

import pytest
import torch

from tiny_models import prefill_logits
from servelm.attention.kv_cache import KVCache, kv_storage_dtype
from servelm.config import CacheConfig, EngineArgs, ModelConfig
from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.runner.model_runner import num_kv_blocks

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
CONFIG = ModelConfig("llama", 32, 576, 1536, 30, 9, 3, 64, 2048)  # SmolLM2-135M's shape


@pytest.mark.parametrize("model_dtype,ratio", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_pool_holds_more_tokens_from_the_same_bytes(model_dtype, ratio):
    budget = 64 * 2**20
    blocks = {}
    for kv in ("auto", "fp8"):
        cache = CacheConfig(block_size=16, kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
        blocks[kv] = num_kv_blocks(CONFIG, cache, kv_storage_dtype(kv, model_dtype),
                                   torch.device("cpu"))
    assert blocks["fp8"] == ratio * blocks["auto"]
    # SmolLM2: 2 (K, V) x 30 layers x 3 KV heads x 64 dims = 11,520 elements per token
    fp8_per_block = KVCache.bytes_per_block(CONFIG, 16, torch.float8_e4m3fn)
    assert fp8_per_block == 11_520 * 16


def test_engine_allocates_fp8_blocks(tiny_hf, tiny_engine):
    hf = tiny_hf("llama")
    budget = 2**20
    engines = {kv: tiny_engine(hf, num_blocks=None, kv_cache_memory=budget, kv_cache_dtype=kv)
               for kv in ("auto", "fp8")}
    caches = {kv: e.runner.kv_cache for kv, e in engines.items()}
    assert caches["fp8"].k.dtype == torch.float8_e4m3fn and caches["fp8"].is_fp8
    assert caches["fp8"].num_blocks == 4 * caches["auto"].num_blocks  # fp32 model
    assert engines["fp8"].block_manager.num_blocks == caches["fp8"].num_blocks
    nbytes = {kv: c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
              for kv, c in caches.items()}
    assert nbytes["fp8"] <= budget and nbytes["auto"] <= budget
    assert caches["fp8"].k_scale.shape == (2, 2) and caches["auto"].k_scale is None


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model="x", kv_cache_dtype="int8").cache_config()


def test_cli_flag():
    import argparse

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_cli_args(parser)
    assert engine_args_from_cli(parser.parse_args(["m"])).kv_cache_dtype == "auto"
    args = engine_args_from_cli(parser.parse_args(["m", "--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8" and args.cache_config().kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "fp4"])


def _score(engine, ids):
    return prefill_logits(engine, ids)


def test_tiny_model_logits_close_to_float_cache(tiny_hf, tiny_engine):
    """Teacher-forced on the float engine's own greedy continuations: every logprob within
    0.3 of the float cache's, and >= 90% of next-token choices the same (measured on this
    random llama: max |d logprob| 0.21, 244/256 agree; its logits span only ~+-2.3, so
    choices are closer than a trained model's)."""
    hf = tiny_hf("llama")
    prompts = _prompts(8, hf.config.vocab_size)
    float_engine, fp8_engine = tiny_engine(hf), tiny_engine(hf, kv_cache_dtype="fp8")
    outs = LLM(engine=float_engine).generate(prompts, GREEDY, use_tqdm=False)
    same = total = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.outputs[0].token_ids
        a, b = _score(float_engine, ids), _score(fp8_engine, ids)
        worst = max(worst, (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item())
        a, b = a.argmax(-1)[len(prompt) - 1:-1], b.argmax(-1)[len(prompt) - 1:-1]
        same, total = same + (a == b).sum().item(), total + len(a)
    assert 1e-3 < worst < 0.3  # fp8 really is in use, and close
    assert same / total >= 0.9, f"{same}/{total} next tokens agree"


def _prompts(n, vocab, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def _same_or_tie(a, b, tol=1e-3):
    """Token lists equal, or the first difference is a near-tie (as in
    tests/engine/test_batching_equivalence.py)."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            top = dict(a.logprobs[i].top)
            assert y in top and abs(top[x] - top[y]) < tol, f"diverged at {i}: {x} vs {y}"
            return
    assert len(a.token_ids) == len(b.token_ids)


@pytest.fixture(scope="module")
def fp8_alone():
    """Each prompt alone on an fp8 cache, prefix caching off."""
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    prompts = _prompts(12, hf.config.vocab_size, seed=1)
    llm = LLM(engine=make_tiny_engine(hf, kv_cache_dtype="fp8", enable_prefix_caching=False))
    return hf, prompts, [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]


@pytest.mark.parametrize("kwargs", [{}, {"num_blocks": 40}, {"max_num_batched_tokens": 7}],
                         ids=["batched", "preempted", "chunked"])
def test_fp8_output_same_batched_preempted_chunked(fp8_alone, tiny_engine, kwargs):
    hf, prompts, alone = fp8_alone
    engine = tiny_engine(hf, kv_cache_dtype="fp8", **kwargs)
    outs = LLM(engine=engine).generate(prompts, GREEDY, use_tqdm=False)
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_blocks" in kwargs:  # 40 blocks of 4 tokens cannot hold 12 sequences of <= 84
        assert engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, outs):
        _same_or_tie(a, b.outputs[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_prefix_cache_hits_keep_output(fp8_alone, tiny_engine, backend):
    """Prompts sharing a 7-token prefix (ends mid-block) read it from fp8 blocks another
    request wrote; outputs match the same prompts run with prefix caching off."""
    hf = fp8_alone[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shared = [7, 200, 31, 5, 99, 42, 18]
    prompts = [shared + [3, 14, 15, 92, 65], shared + [11, 12], shared]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for caching in (False, True):
        engine = tiny_engine(hf, kv_cache_dtype="fp8", enable_prefix_caching=caching,
                             attention_backend=backend, device=device)
        llm = LLM(engine=engine)
        llm.generate([shared + [1]], params, use_tqdm=False)  # writes the shared blocks
        runs[caching] = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.timings.num_cached_tokens == 4 for o in runs[True])  # one full block
    for a, b in zip(runs[False], runs[True]):
        _same_or_tie(a.outputs[0], b.outputs[0])


@pytest.mark.slow
def test_default_model_perplexity_with_fp8_cache(default_model_path):
    """The default model on the held-out text (windows of 1,024): measured 25.887 (fp32
    cache) -> 25.990 (fp8), +0.40%."""
    from servelm.evals.perplexity import perplexity

    text = _heldout_text()  # default_model_path: the model is pulled (a failed pull fails)
    ppl = {}
    for kv in ("auto", "fp8"):
        llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 * 2**20, max_model_len=1024,
                  kv_cache_dtype=kv)
        ppl[kv] = perplexity(llm.engine, text, window=1024).perplexity
    assert 3 < ppl["auto"] < 40
    assert abs(ppl["fp8"] / ppl["auto"] - 1) <= 0.01, ppl


def _heldout_text():
    from pathlib import Path

    import servelm.evals

    return (Path(servelm.evals.__file__).parent / "data" / "heldout_en.txt").read_text()
