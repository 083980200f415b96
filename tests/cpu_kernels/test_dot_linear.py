"""DotLinear (cpu_kernels/dot_gemm.cpp) computes the bfloat16 linear on avx512_bf16 dot
products: against a float64 reference on odd shapes (rows past a multiple of 8, column blocks
past a multiple of 3, odd K, a bias), for any split of the rows and columns between threads;
each output's sum runs in one fixed order, so a row's result does not depend on the other rows
of its step. The gated form is silu_and_mul of the product, and steps aside for a layer that
cannot fuse or whose output is hooked. Where vdpbf16ps does not run, the op says why."""

import pytest
import torch
from bf16_linears import check_strided_rows_and_3d_input

from servelm import cpu_kernels
from servelm.layers.activation import gate_up_silu, silu_and_mul
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
@pytest.mark.parametrize("m,n,k,bias", [(64, 49152 // 64, 576, False), (9, 50, 33, True),
                                        (1, 112, 31, True),
                                        # >= 4 MiB of output: streamed to memory, rows
                                        # 64-byte aligned, then not (a scalar tail)
                                        (64, 16400, 96, False), (40, 26237, 64, True)])
def test_the_float_form_is_the_sums_the_bf16_form_rounds(m, n, k, bias):
    x, w, b = _problem(m, n, k, bias, 11 * m + n)
    layer = DotLinear(w, b)
    rounded = layer(x)
    layer.float_out()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y.bfloat16(), rounded)  # the same float32 sums, rounded once
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)


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
    check_strided_rows_and_3d_input(DotLinear)


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
    with pytest.raises(RuntimeError, match="dot_linear_float: x must be a bfloat16"):
        ops.dot_linear_float(torch.randn(2, 64), packed, None, 32)


@needs_dot
@pytest.mark.parametrize("m", [1, 9, 64, 130])
@pytest.mark.parametrize("i,k,bias", [(1536, 576, False), (48, 64, True), (16, 33, True),
                                      (80, 32, False)])
def test_the_gated_form_is_silu_and_mul_of_the_linear(m, i, k, bias):
    x, w, b = _problem(m, 2 * i, k, bias, m + i + k)
    layer = DotLinear(w, b)
    assert layer.gated
    y = layer.silu_and_mul(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, i)
    gu = x.double() @ w.double().t() + (b.double() if bias else 0)
    gate, up = gu[:, :i], gu[:, i:]
    ref = gate * torch.sigmoid(gate) * up
    # gate and up stay float32 (no bfloat16 rounding between the product and the activation)
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2 ** -7)
    two_step = silu_and_mul(layer(x))  # rounds gate and up to bfloat16 first
    torch.testing.assert_close(y.float(), two_step.float(), atol=5e-2, rtol=2 ** -6)


@needs_dot
def test_a_layer_that_cannot_fuse_falls_back_and_the_op_refuses_it():
    x, w, _ = _problem(4, 2 * 24, 32, False, 1)  # I = 24: not a multiple of 16
    layer = DotLinear(w, None)
    assert not layer.gated
    assert torch.equal(layer.silu_and_mul(x), silu_and_mul(layer(x)))
    with pytest.raises(RuntimeError, match="n must be 2 I with I a multiple of 16"):
        torch.ops.servelm_cpu.dot_linear_silu(x, layer.packed_weight, None, 48)


@needs_dot
def test_gate_up_silu_leaves_a_hooked_layer_unfused():
    x, w, _ = _problem(3, 64, 32, False, 2)
    layer = DotLinear(w, None)
    assert torch.equal(gate_up_silu(layer, x), layer.silu_and_mul(x))
    seen = []
    handle = layer.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    try:
        assert torch.equal(gate_up_silu(layer, x), silu_and_mul(layer(x)))
    finally:
        handle.remove()
    assert seen == [(3, 64), (3, 64)]  # the hook saw the product, both times


@needs_dot
@pytest.mark.parametrize("m", [32, 40, 65, 72])
def test_a_narrow_layer_whose_last_row_parts_are_empty(m):
    """One group of columns (N = 48) over rows split in parts of whole row blocks: at some
    row counts the last parts have no rows (65 rows in 4 parts of 24), which must be skipped,
    not divided by."""
    x, w, b = _problem(m, 48, 64, True, m)
    layer = DotLinear(w, b)
    threads = torch.get_num_threads()
    try:
        for n in (2, 8, 16):
            torch.set_num_threads(n)
            y = layer(x)
            ref = x.double() @ w.double().t() + b.double()
            torch.testing.assert_close(y.double(), ref, atol=1e-2, rtol=2 ** -7)
    finally:
        torch.set_num_threads(threads)
