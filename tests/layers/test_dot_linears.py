"""A bfloat16 model's linears on servelm's avx512_bf16 GEMM (layers/dot_linear.py): where the
probe saw vdpbf16ps run and AMX does not, the engine makes every float linear (a tied head's
copy too) a DotLinear at every row count, the head's logits stay float32, the decode stack
takes them, and `--cpu-kernels gemm=torch` keeps oneDNN; the logits agree with the float32
model's and oneDNN's."""

import pytest
import torch
from torch import nn

from servelm.layers.amx_linear import amx_usable
from servelm.layers.dot_linear import DotLinear, dot_usable
from servelm.layers.linear import PackedLinear, pack_dot_linears
from bf16_linears import TiedTiny, bf16_engine
from tiny_models import greedy, prefill_logits

needs_dot = pytest.mark.skipif(not dot_usable() or amx_usable(),
                               reason="avx512_bf16 does not run here, or AMX does (it pairs)")


@needs_dot
def test_every_bf16_linear_and_a_tied_head_become_dot_linears():
    torch.manual_seed(0)
    model = TiedTiny()
    w, b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    assert pack_dot_linears(model) == 2
    assert type(model.proj) is DotLinear and type(model.lm_head) is DotLinear
    assert torch.equal(model.lm_head.dense_weight(), model.embed_tokens.weight)
    x = torch.randn(5, 32).bfloat16()
    want = x.float() @ w.float().t() + b.float()
    torch.testing.assert_close(model.proj(x).float(), want, rtol=2 ** -7, atol=1e-2)
    # the head's logits are its float32 sums: no bfloat16 ties at the maximum to refine
    logits = model.lm_head(x)
    assert logits.dtype == torch.float32 and model.proj(x).dtype == torch.bfloat16
    want = x.double() @ model.embed_tokens.weight.double().t()
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)


@needs_dot
def test_a_bf16_engine_runs_its_linears_on_dot_products(tiny_hf, tiny_engine, caplog):
    hf, dots, log = bf16_engine(tiny_hf, tiny_engine, caplog, "auto")
    assert log.endswith("gemm=dot")
    model = dots.runner.model
    assert sum(type(m) is DotLinear for m in model.modules()) == 2 * 4 + 1
    assert not any(type(m) in (PackedLinear, nn.Linear) for m in model.modules())
    _, plain, log = bf16_engine(tiny_hf, tiny_engine, caplog, "gemm=torch")
    assert log.endswith("gemm=onednn")
    assert not any(type(m) is DotLinear for m in plain.runner.model.modules())
    prompt = [int(t) for t in torch.randint(0, 384, (100,), generator=torch.Generator()
                                            .manual_seed(3))]
    calls = []
    real = torch.ops.servelm_cpu.dot_linear

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    stack = dots.runner.cpu_stack
    assert stack is not None
    out = greedy(dots, prompt[:20], 6)
    assert len(out) == 6 and stack._stacks  # decode steps ran through the C++ stack
    with torch.no_grad():
        want = hf.to(torch.float32)(torch.tensor([prompt])).logits[0]
    import servelm.layers.dot_linear as dl
    try:
        dl.torch.ops.servelm_cpu.dot_linear = counting  # the eager prefill's calls
        got = prefill_logits(dots, prompt)
    finally:
        dl.torch.ops.servelm_cpu.dot_linear = real
    assert 100 in calls
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    # two bfloat16 paths: the dots keep the gate and up float32 into silu_and_mul
    torch.testing.assert_close(got, prefill_logits(plain, prompt), rtol=0.03, atol=0.03)
