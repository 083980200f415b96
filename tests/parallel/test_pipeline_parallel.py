"""Pipeline parallelism over gloo: layers split into two stages, each step's sequences sent
through them in micro-batches (stage 1 works on the first while stage 0 computes the next).
One stage per process (TP=1 x PP=2) is bitwise the single process's computation (a layer's
arithmetic does not change, only where it runs); TP=2 x PP=2 (four processes) matches
within float32 tolerance, as TP=2 does."""

from __future__ import annotations

import pytest
from parallel_helpers import build, max_logprob_diff, run_greedy, save_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("pp-models")


def _run(path: str, **kwargs):
    from servelm.layers.parallel_linear import TensorParallelModel

    engine = build(path, **kwargs)
    runner = engine.runner
    try:
        model = runner.model
        assert isinstance(model, TensorParallelModel) and model.pipeline is not None
        runner.group.stats.reset()
        tokens, lps = run_greedy(engine)
        facts = dict(num_layers=len(model.layers), kv_layers=runner.kv_cache.k.shape[0],
                     sends=runner.group.stats.by_op.get("send", 0))
    finally:
        runner.close()
    return tokens, lps, facts


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3_full",
                                    pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_tp1_pp2_is_the_single_process_computation(models, family):
    """Every family's stages run the model's one forward (layers, then the stream handed
    on): a Gemma stage embeds with its scale, the last alone applies the final norm.
    Within float32 rounding where a micro-batch changes a row's arithmetic, bitwise
    elsewhere: Gemma's sliding-window layers take the window's kernel only in a batch with a
    context past the window, and a mixture of experts multiplies each expert's rows of the
    (micro-)batch together."""
    path = save_tiny(family, models, num_hidden_layers=4)
    ref_tokens, ref_lps = run_greedy(build(path))
    tokens, lps, facts = _run(path, pipeline_parallel_size=2)
    assert tokens == ref_tokens
    if family in ("llama", "phi3_full"):
        assert lps == ref_lps
    else:
        assert max_logprob_diff(lps, ref_lps) < 1e-5
    assert facts["num_layers"] == facts["kv_layers"] == 2  # stage 0: layers 0-1 and their KV
    # micro-batches: 3 prompts in 2 micro-batches in the prefill, hidden and residual each
    assert facts["sends"] >= 4 + 2 * 7


@pytest.mark.parametrize("family", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_tp2_pp2_matches_one_process(models, family):
    path = save_tiny(family, models, num_hidden_layers=4)
    ref_tokens, ref_lps = run_greedy(build(path))
    tokens, lps, facts = _run(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert tokens == ref_tokens
    assert max_logprob_diff(lps, ref_lps) < 1e-4
    assert facts["num_layers"] == 2


def test_split_batch_keeps_whole_sequences_in_order():
    import torch

    from servelm.parallel.pipeline import split_batch
    from servelm.attention.forward_batch import ForwardBatch

    qsl = [0, 1, 2, 7, 10]  # two decodes, then prefill chunks of 5 and 3
    t = torch.arange(10)
    fb = ForwardBatch(t, t, t, torch.zeros(4, 3, dtype=torch.long), qsl, [4, 6, 0, 2],
                      [5, 7, 5, 5], 2, 4, torch.tensor([0, 1, 6, 9]))
    parts = split_batch(fb, 2)
    assert [(lo, hi) for lo, hi, _ in parts] == [(0, 7), (7, 10)]
    first, second = parts[0][2], parts[1][2]
    assert first.query_start_loc == [0, 1, 2, 7] and first.num_decodes == 2
    assert second.query_start_loc == [0, 3] and second.num_decodes == 0
    assert second.context_lens == [2] and second.input_ids.tolist() == [7, 8, 9]
