"""`servelm_cpu::logit_rows` (cpu_kernels/logit_rows.cpp) against torch: the float32 copy is
exact, the argmax is torch's (first maximum; a NaN is the largest), and `near` counts the
logits within one bfloat16 step of the maximum as servelm/runner/logits.py defines it."""

from __future__ import annotations

import pytest
import torch

from servelm import cpu_kernels


@pytest.fixture(scope="module")
def ops():
    return cpu_kernels.load()


def _near(x: torch.Tensor) -> torch.Tensor:
    f = x.float()
    top = f.max(dim=-1, keepdim=True).values
    step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)
    return (f >= top - step).sum(-1).int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 1003])
def test_matches_torch(ops, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(7, vocab, generator=g) * 8).to(dtype)
    if vocab > 16:  # exact ties at the maximum, one of them before the other
        x[2, vocab // 3] = x[2, vocab - 2] = x[2].max() + 1
        x[3, :] = 2.0  # every logit the maximum
        x[4, vocab // 2] = float("nan")
        x[5, :] = float("-inf")
        x[6, 5] = float("inf")
        x[0, 32] = x[0, 16] = x[0].max() + 1  # a tie in one lane of 16: the first
        x[1, 17] = x[1, vocab - 1] = x[1].max() + 1  # ... and with the row's last logit
    out, argmax, near = ops.logit_rows(x)
    assert out.dtype == torch.float32 and torch.equal(out.nan_to_num(), x.float().nan_to_num())
    assert (out.data_ptr() == x.data_ptr()) == (dtype == torch.float32)  # float32: no copy
    assert torch.equal(argmax, x.float().argmax(dim=-1))
    finite = x.float().nan_to_num(0).isfinite().all(-1) & ~x.float().isnan().any(-1)
    finite &= x.float().max(-1).values.isfinite()
    assert torch.equal(near[finite], _near(x)[finite])
    assert (near[~finite] == 1).all()
    if vocab > 16:
        assert argmax[2] == vocab // 3 and near[2] >= 2 and near[3] == vocab
        assert argmax[0] == 16 and argmax[1] == 17


def test_bad_input_is_named(ops):
    with pytest.raises(RuntimeError, match="logit_rows: x must be"):
        ops.logit_rows(torch.zeros(2, 3, 4))
    with pytest.raises(RuntimeError, match="logit_rows: x must be"):
        ops.logit_rows(torch.zeros(4, 3).t())
