"""DotLinear (cpu_kernels/dot_gemm.cpp) computes the bfloat16 linear on avx512_bf16 dot
products: against a float64 reference on odd shapes (rows past a multiple of 8, column blocks
past a multiple of 3, odd K, a bias), for any split of the rows and columns between threads;
each output's sum runs in one fixed order, so a row's result does not depend on the other rows
of its step. Where vdpbf16ps does not run, the op says why."""

import pytest
import torch

from servelm import cpu_kernels
from servelm.layers.amx_linear import pack_weight
from servelm.layers.dot_linear import DotLinear, dot_usable

needs_dot = pytest.mark.skipif(not dot_usable(), reason="avx512_bf16 does not run on this CPU")


def _problem(m, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16() if bias else None
    return torch.randn(m, k, generator=gen).bfloat16(), w, b


@needs_dot
@pytest.mark.parametrize("m", [1, 7, 8, 9, 64, 100, 300])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (17, 64, True),
                                      (50, 33, False), (16, 32, False), (112, 31, True)])
def test_dot_linear_matches_reference(m, n, k, bias):
    x, w, b = _problem(m, n, k, bias, m * 1000 + n + k)
    y = DotLinear(w, b)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    # float32 sums of exact bf16 products, then one rounding to bfloat16 (2^-8 relative)
    torch.testing.assert_close(y.double(), ref, atol=1e-2, rtol=2 ** -7)
    want = (x.float() @ w.float().t() + (b.float() if bias else 0)).bfloat16()
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


@needs_dot
@pytest.mark.parametrize("n,k", [(960, 576), (16, 40)])  # many column groups; one (rows split)
def test_a_rows_result_does_not_depend_on_its_step_or_the_threads(n, k):
    x, w, b = _problem(200, n, k, True, 7)
    layer = DotLinear(w, b)
    full = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)
    for rows in (slice(0, 1), slice(5, 13), slice(64, 200)):
        assert torch.equal(layer(x[rows].contiguous()), full[rows])


@needs_dot
def test_dot_linear_takes_strided_rows_and_3d_input():
    w = torch.randn(64, 96).bfloat16()
    layer = DotLinear(w, None)
    big = torch.randn(3, 7, 200).bfloat16()
    x = big[..., 10:106]  # rows 200 apart
    want = (x.float() @ w.float().t()).bfloat16()
    got = layer(x)
    assert got.shape == (3, 7, 64)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


def test_dot_linear_rejects_bad_inputs():
    ops = cpu_kernels.load()
    packed = pack_weight(torch.randn(32, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    if not dot_usable():
        with pytest.raises(RuntimeError, match="avx512_bf16"):
            ops.dot_linear(x, packed, None, 32)
        return
    with pytest.raises(RuntimeError, match="does not hold"):
        ops.dot_linear(x, packed, None, 48)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        ops.dot_linear(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.dot_linear(x, packed, torch.zeros(32).bfloat16(), 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.dot_linear(x, packed.view(2, 2, 16, 32)[:, :1], None, 32)
