"""Tensor parallelism over gloo on the CPU: a tiny random model of every family, served by two
worker processes (rank 0 here, rank 1 a child), gives the same greedy tokens as one process
and logprobs within float32 tolerance.

Where the sums reorder (why the logprobs are close, not bitwise equal): each row-parallel
projection (o_proj, down_proj, an expert's down) adds two partial sums of half the heads /
half the MLP width, where one process's GEMM adds all the terms in its own blocked order;
the embedding all-reduce adds zeros (exact) and the head's all-gather concatenates (exact).
"""

from __future__ import annotations

import pytest
from parallel_helpers import PROMPTS, build, max_logprob_diff, run_greedy, save_tiny

from servelm.parallel.sharding import TensorParallelShard

# (family, overrides): every family the engine serves, with MQA (fewer KV heads than ranks:
# each rank holds a copy of the one KV head) and an MLA model in both DeepSeek variants.
FAMILIES = [
    ("llama", {}), ("llama", {"num_key_value_heads": 1}),
    # 3 KV heads over 2 ranks (the default model's shape): rank 0 holds one KV head and its 2
    # query heads, rank 1 two and 4
    ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}),
    ("qwen3", {}), ("gemma2", {}),
    ("phi3", {}), ("mixtral", {}), ("qwen2_moe", {}), ("deepseek_v3", {}),
]
# The other families: the same code paths as one above (Qwen2: Llama + q/k/v biases, as
# Qwen2-MoE; Mistral: Llama + a window, as Gemma 2; Gemma 3: Gemma 2's layers; Qwen3-MoE:
# Mixtral's experts + Qwen3's q/k norms; DeepSeek-V2: V3's MLA with one q_proj).
MORE_FAMILIES = [("qwen2", {}), ("mistral_window", {}), ("gemma3", {}), ("qwen3_moe", {}),
                 ("deepseek_v2", {})]
TOLERANCE = 1e-4  # logprobs of magnitude ~1-10: float32 rounding of a reordered sum is ~1e-6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-models")


def _tp2(path: str, **kwargs):
    """(tokens, logprobs, facts about rank 0's shard) of a TP=2 engine, closed after."""
    from servelm.layers.parallel_linear import TensorParallelModel
    from servelm.parallel.runner import ParallelRunner

    engine = build(path, tensor_parallel_size=2, **kwargs)
    runner = engine.runner
    try:
        assert isinstance(runner, ParallelRunner) and isinstance(runner.model,
                                                                 TensorParallelModel)
        assert not runner.workers.dead()
        runner.group.stats.reset()
        tokens, lps = run_greedy(engine)
        facts = dict(stats=runner.group.stats, local=runner.model.config,
                     kv_heads=runner.kv_cache.k.shape[2], workers=runner.workers)
    finally:
        runner.close()
    return tokens, lps, facts


def _ids(families):
    return [f + "".join(f"-{k}{v}" for k, v in o.items()) for f, o in families]


@pytest.mark.parametrize("family,overrides", [
    *FAMILIES, *(pytest.param(*f, marks=pytest.mark.slow) for f in MORE_FAMILIES)],
    ids=_ids(FAMILIES + MORE_FAMILIES))
def test_tp2_matches_one_process(models, family, overrides):
    path = save_tiny(family, models, **overrides)
    ref = build(path)
    ref_tokens, ref_lps = run_greedy(ref)
    tokens, lps, facts = _tp2(path)
    assert tokens == ref_tokens
    assert max_logprob_diff(lps, ref_lps) < TOLERANCE
    # It ran sharded: half the query heads here, the KV heads split (or one copy each), and
    # two all-reduces per layer and step (after attention, after the MLP) plus the embedding's.
    whole = ref.model_config
    shard = TensorParallelShard(whole, 0, 2)
    assert facts["local"].num_heads == shard.q_heads[1]
    assert shard.q_heads[1] == (2 if whole.num_kv_heads == 3 else whole.num_heads // 2)
    assert facts["kv_heads"] == (1 if whole.is_mla else shard.kv_heads[1])
    stats = facts["stats"]
    assert stats.all_reduce_calls % (2 * whole.num_layers + 1) == 0 and stats.all_reduce_calls
    assert stats.by_op["all_gather"] >= 8  # the head: every step's logits
    if family == "llama" and not overrides:  # the bytes the planner's formula says
        from servelm.planner.tp_comm import allreduce_bytes_per_step

        num_tokens = sum(map(len, PROMPTS)) + 7 * len(PROMPTS)  # prefill, then 7 decodes
        assert stats.all_reduce_bytes == allreduce_bytes_per_step(
            whole.hidden_size, whole.num_layers, num_tokens, 4)
    assert all(p.poll() is not None for p in facts["workers"].procs.values())  # closed


def test_tp2_int8_shards_the_quantized_linears(models):
    """int8 weight-only quantizes each rank's shard after loading: the head and column-
    parallel rows keep their per-row scales; the row-parallel halves get their own."""
    from servelm.quant.quantized_linear import QuantizedLinear

    path = save_tiny("llama", models)
    _, ref_lps = run_greedy(build(path, quantization="int8"), max_tokens=1)
    _, float_lps = run_greedy(build(path), max_tokens=1)
    engine = build(path, tensor_parallel_size=2, quantization="int8")
    try:
        layer = engine.runner.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
        assert layer.self_attn.o_proj.in_features == 32  # half of the 64 query features
        _, lps = run_greedy(engine, max_tokens=1)  # teacher-forced: the prompts' logprobs
    finally:
        engine.runner.close()
    # Differently rounded than one process's int8 (o_proj/down halves have their own row
    # scales), about as far from it as it is from float.
    quant_error = max_logprob_diff(ref_lps, float_lps)
    print(f"int8 TP=2 vs int8 TP=1 {max_logprob_diff(lps, ref_lps):.4f}, int8 vs float "
          f"{quant_error:.4f}")
    assert 0 < max_logprob_diff(lps, ref_lps) < 2 * quant_error


def test_unsplittable_shapes_and_unsupported_options_are_refused_by_name(models):
    from servelm.config import EngineArgs, ModelConfig
    from servelm.parallel.launcher import check_supported
    from servelm.parallel.sharding import ShardingError, TensorParallelShard
    from servelm.protocol import InvalidParameterError

    config = ModelConfig("llama", 384, 64, 128, 2, 4, 2, 16, 1024)
    with pytest.raises(ShardingError, match="4 attention heads") as e:
        TensorParallelShard(config, 0, 3)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(ShardingError, match="KV heads"):  # 3 KV heads do not copy to 4
        TensorParallelShard(config.replace(num_heads=12, num_kv_heads=3), 0, 4)
    with pytest.raises(ShardingError, match="stages"):
        TensorParallelShard(config, 0, 1, num_stages=3)
    with pytest.raises(InvalidParameterError) as e:
        check_supported(EngineArgs(model="m", tensor_parallel_size=2,
                                   speculative_method="ngram"))
    assert e.value.param == "speculative_method"
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineArgs(model="m", enable_expert_parallel=True).parallel_config()


def test_a_rank_reads_only_its_slices(models):
    """The loader hands `select` safetensors slices; each rank's tensors are its part."""
    from servelm.loader import iter_weights, load_model_config, resolve_model
    from servelm.parallel.sharding import TensorParallelShard

    source = resolve_model(save_tiny("phi3", models))  # fused qkv / gate_up in the file
    config = load_model_config(source)
    full = dict(iter_weights(source, config))
    parts = [dict(iter_weights(source, config, TensorParallelShard(config, r, 2).select))
             for r in (0, 1)]
    q, kv = config.q_size, config.kv_size
    name = "model.layers.0.self_attn.qkv_proj.weight"
    for r, part in enumerate(parts):
        w = part[name]
        assert w.shape == ((q + 2 * kv) // 2, config.hidden_size)
        assert (w[:q // 2] == full[name][r * q // 2:(r + 1) * q // 2]).all()
        o = part["model.layers.0.self_attn.o_proj.weight"]
        assert (o == full["model.layers.0.self_attn.o_proj.weight"].chunk(2, dim=1)[r]).all()
        assert part["model.embed_tokens.weight"].shape[0] == config.vocab_size // 2


@pytest.mark.slow  # the default model, read whole for comparison
def test_gguf_slices_read_in_parts_equal_the_whole_tensor_narrowed(default_model_path):
    """The default model's Q4_1 GGUF: each rank's rows (and aligned column blocks) read and
    dequantized alone, the rotary permutation undone per head, equal the whole tensors
    dequantized then narrowed."""
    from servelm.loader import iter_weights, load_model_config, resolve_model
    from servelm.parallel.sharding import TensorParallelShard, select_all

    source = resolve_model(str(default_model_path))
    config = load_model_config(source)
    shard = TensorParallelShard(config, 1, 2)  # the uneven rank: KV heads 1-2 of 3
    parts = dict(iter_weights(source, config, shard.select))
    whole = dict(select_all(shard, iter_weights(source, config)))
    assert parts.keys() == whole.keys()
    for name, t in whole.items():
        assert parts[name].shape == t.shape and (parts[name] == t).all(), name
    q = parts["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape[0] == 6 * config.head_dim


@pytest.mark.slow  # builds the default model three times
def test_default_model_tp2_keeps_its_gguf_blocks_quantized(default_model_path):
    """The default model (3 KV heads: split 1 and 2) with --quantization gguf: each rank
    keeps its rows and column blocks of the Q4_1 file as blocks, greedy as one process."""
    from servelm.loader.model_cache import DEFAULT_MODEL
    from servelm.quant.quantized_linear import QuantizedLinear

    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 20, 30]]
    ref_tokens, ref_lps = run_greedy(build(DEFAULT_MODEL, quantization="gguf"), prompts)
    engine = build(DEFAULT_MODEL, quantization="gguf", tensor_parallel_size=2)
    try:
        attn = engine.runner.model.layers[0].self_attn
        assert isinstance(attn.o_proj, QuantizedLinear) and attn.num_kv_heads == 1
        assert attn.o_proj.in_features == 3 * 64  # rank 0: one KV head's 3 query heads
        tokens, lps = run_greedy(engine, prompts)
    finally:
        engine.runner.close()
    assert tokens == ref_tokens
    assert max_logprob_diff(lps, ref_lps) < 1e-3


def test_a_shape_that_does_not_split_fails_the_build_and_stops_the_workers(models):
    """4 heads over 3 ranks: the build fails naming tensor_parallel_size, the two workers it
    started are stopped and the process group left, so the next engine can start its own."""
    import os
    from pathlib import Path

    from servelm.parallel.sharding import ShardingError

    def workers() -> list[int]:  # this process's live worker children
        out = []
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            for pid in (task / "children").read_text().split():
                proc = Path(f"/proc/{pid}")
                if (b"servelm.core_process.worker" in (proc / "cmdline").read_bytes()
                        and (proc / "stat").read_text().split(")")[1].split()[0] != "Z"):
                    out.append(int(pid))
        return out

    path = save_tiny("llama", models)
    with pytest.raises(ShardingError, match="4 attention heads") as e:
        build(path, tensor_parallel_size=3)
    assert e.value.param == "tensor_parallel_size"
    assert workers() == []
    tokens, _, _ = _tp2(path)  # a new group in the same process
    assert tokens == run_greedy(build(path))[0]
