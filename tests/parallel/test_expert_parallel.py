"""Expert parallelism over gloo: a tiny MoE's experts split between two ranks (whole experts,
tokens dispatched and combined by all-to-all, shared experts replicated) gives the same
greedy tokens as one process, logprobs within float32 tolerance (each expert's GEMM runs
over fewer rows; the per-token sum keeps ascending expert order)."""

from __future__ import annotations

import pytest
from parallel_helpers import build, max_logprob_diff, run_greedy, save_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("ep-models")


# Mixtral: 4 experts, top-2, no shared expert; Qwen2-MoE: 8 experts and a gated shared
# expert; DeepSeek-V3: sigmoid group routing, a dense first layer, MLA attention.
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe",
                                    pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_ep2_matches_one_process(models, family):
    from servelm.layers.parallel_moe import ExpertParallelExperts

    path = save_tiny(family, models)
    ref = build(path)
    ref_tokens, ref_lps = run_greedy(ref)
    ref_load = [m.num_routed_tokens.tolist() for m in ref.runner._experts]  # + warm-up
    engine = build(path, tensor_parallel_size=2, enable_expert_parallel=True)
    runner = engine.runner
    try:
        experts = [m for m in runner.model.modules() if isinstance(m, ExpertParallelExperts)]
        config = ref.model_config
        assert len(experts) == config.num_moe_layers
        assert all(e.num_local == config.num_experts // 2 and e.first == 0 for e in experts)
        assert experts[0].w13.shape[0] == config.num_experts // 2  # whole experts, half
        assert experts[0].w13.shape[1] == 2 * config.moe_intermediate_size  # of them
        runner.group.stats.reset()
        tokens, lps = run_greedy(engine)
        load = [m.num_routed_tokens.tolist() for m in runner.local._experts]  # + warm-up
        assert runner.group.stats.by_op["all_to_all"] > 0
    finally:
        runner.close()
    assert tokens == ref_tokens
    assert max_logprob_diff(lps, ref_lps) < 1e-4
    assert load == ref_load  # every token routed as one process routes it
