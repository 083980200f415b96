"""The routed experts' C++ op (cpu_kernels/moe_experts.cpp, decode-sized steps): the same
rows as the per-expert aten path, for experts with 1 to 16 tokens, widths with vector tails,
and a tiny Mixtral decoding through it gives transformers' greedy tokens."""

import pytest
import torch

from servelm import cpu_kernels
from servelm.layers.activation import silu_and_mul
from servelm.layers.moe import CPU_KERNEL_MAX_ROWS, Experts, RoutingConfig, route

pytestmark = pytest.mark.skipif(cpu_kernels.ops_for_mode("layer_ops", "auto") is None,
                                reason="servelm's C++ CPU kernels did not build here")


def _experts(e, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, hidden, inter, silu_and_mul)
    ex.w13.data = torch.randn(e, 2 * inter, hidden, generator=g) * 0.1
    ex.w2.data = torch.randn(e, hidden, inter, generator=g) * 0.1
    return ex


@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 32), (5, 72, 40), (16, 64, 48),
                                                 (40, 48, 24)])
def test_kernel_rows_match_the_aten_path(tokens, hidden, inter):
    ex = _experts(8, hidden, inter, seed=tokens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, 8, generator=g), RoutingConfig(top_k=2))
    got = ex(x, weights, ids)
    used = ex.num_cpu_kernel_calls
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    assert used == (1 if int(counts.max()) <= CPU_KERNEL_MAX_ROWS else 0)
    ex._cpu_op = lambda rows, counts: None  # the per-expert aten matmuls
    ref = ex(x, weights, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused():
    ops = cpu_kernels.load()
    w13, w2 = torch.zeros(2, 8, 16), torch.zeros(2, 16, 4)
    with pytest.raises(RuntimeError, match="counts sum"):
        ops.moe_experts(torch.zeros(3, 16), torch.tensor([1, 1]), w13, w2)
    with pytest.raises(RuntimeError, match="w13 must be"):
        ops.moe_experts(torch.zeros(2, 16), torch.tensor([1, 1]), w13, torch.zeros(2, 8, 4))


def test_tiny_mixtral_decodes_through_the_kernel():
    from tiny_families import make_tiny_family_model
    from tiny_models import greedy, make_tiny_engine

    hf = make_tiny_family_model("mixtral")
    engine = make_tiny_engine(hf)
    prompt = [5, 17, 99, 3, 250, 11, 42]
    out = greedy(engine, prompt, 24)
    moes = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
    assert moes and all(m.num_cpu_kernel_calls >= 23 for m in moes)  # every decode step
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 7,
                          dtype=torch.long), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert out == ref[0, 7:].tolist()
