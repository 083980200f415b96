"""The C++ decode stack on tensor-parallel ranks: each rank's all-decode steps run as one C++
call over its shard (its heads, its slice of the MLP), with the all-reduces after o_proj and
down_proj inside it (torch's functional collectives over gloo, called from C++).

It runs the eager TP path's kernels in its order and sums the same partial products in the
same all-reduces, so its logprobs equal the eager TP path's bit for bit; against one process
they are within the float32 tolerance of test_tensor_parallel.py (the row-parallel sums
reorder)."""

from __future__ import annotations

import pytest
from parallel_helpers import build, max_logprob_diff, run_greedy, save_tiny
from test_tensor_parallel import TOLERANCE

# The default model's shape (3 KV heads over 2 ranks: uneven heads per rank), Qwen3's
# per-head q/k norms, and Phi-3 (its checkpoint's packed qkv and gate/up, each rank's slices
# of them) through the same fast-path spec.
FAMILIES = [("llama", {"hidden_size": 96, "num_attention_heads": 6,
                       "num_key_value_heads": 3}), ("qwen3", {}), ("phi3_full", {})]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-stack-models")


def _tp2(path: str, decode: str):
    """(tokens, logprobs, rank 0's stack, the steps it ran, the group's CommStats) of a TP=2
    engine (its warm-up steps not counted)."""
    engine = build(path, tensor_parallel_size=2, cpu_kernels=f"decode={decode}")
    runner = engine.runner
    try:
        runner.group.stats.reset()
        before = getattr(runner.cpu_stack, "steps", 0)
        tokens, lps = run_greedy(engine)
        steps = getattr(runner.cpu_stack, "steps", 0) - before
        return tokens, lps, runner.cpu_stack, steps, runner.group.stats
    finally:
        runner.close()


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_tp2_stack_equals_the_eager_tp_path(models, family, overrides):
    from servelm.parallel.decode_stack import TensorParallelDecodeStack

    path = save_tiny(family, models, **overrides)
    ref_tokens, ref_lps = run_greedy(build(path))
    tokens, lps, stack, steps, stats = _tp2(path, "kernel")
    eager_tokens, eager_lps, eager_stack, _, eager_stats = _tp2(path, "torch")
    assert isinstance(stack, TensorParallelDecodeStack) and eager_stack is None
    assert steps == 7  # every decode step (the first step prefills, eagerly)
    assert tokens == eager_tokens == ref_tokens
    assert max_logprob_diff(lps, eager_lps) == 0.0
    assert max_logprob_diff(lps, ref_lps) < TOLERANCE
    # The stack's all-reduces are counted as the eager hooks count theirs, and timed in C++.
    assert (stats.all_reduce_calls, stats.all_reduce_bytes) == (
        eager_stats.all_reduce_calls, eager_stats.all_reduce_bytes)
    assert stats.all_reduce_s > 0


def test_pipeline_stages_run_eagerly(models):
    """A pipeline stage waits on the previous stage between layers: no stack there."""
    path = save_tiny("llama", models)
    engine = build(path, tensor_parallel_size=1, pipeline_parallel_size=2,
                   cpu_kernels="decode=kernel")
    try:
        assert engine.runner.cpu_stack is None
    finally:
        engine.runner.close()
