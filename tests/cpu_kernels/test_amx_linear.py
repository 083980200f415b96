"""AmxLinear (cpu_kernels/amx_gemm.cpp) computes the bfloat16 linear: against a float64
reference on odd shapes, rows past a multiple of 16, K not a multiple of 32, a bias; the
packing round-trips; where AMX does not run, the layer is never chosen and the op says why."""

import pytest
import torch
from bf16_linears import check_strided_rows_and_3d_input

from servelm import cpu_kernels
from servelm.layers.amx_linear import AmxLinear, amx_usable, pack_weight, unpack_weight

needs_amx = pytest.mark.skipif(not amx_usable(), reason="AMX-BF16 does not run on this CPU")


@pytest.mark.parametrize("n,k", [(960, 576), (17, 32), (48, 40), (33, 1536)])
def test_packing_round_trips(n, k):
    w = torch.randn(n, k).bfloat16()
    packed = pack_weight(w)
    assert packed.shape == (-(-n // 16), -(-k // 32), 16, 32)
    assert torch.equal(unpack_weight(packed, n, k), w)


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (17, 64, True),
                                      (50, 40, False), (16, 32, False)])
def test_amx_linear_matches_reference(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16() if bias else None
    x = torch.randn(m, k, generator=gen).bfloat16()
    layer = AmxLinear(w, b)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    # float32 sums of exact bf16 products, then one rounding to bfloat16 (2^-8 relative)
    torch.testing.assert_close(y.double(), ref, atol=1e-2, rtol=2 ** -7)
    # ... which is what rounding the float32 result of the same products gives, up to the
    # order of the sums: at most one bfloat16 step apart
    want = (x.float() @ w.float().t() + (b.float() if bias else 0)).bfloat16()
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


@needs_amx
def test_amx_linear_takes_strided_rows_and_3d_input():
    check_strided_rows_and_3d_input(AmxLinear)


def test_amx_linear_rejects_bad_inputs():
    ops = cpu_kernels.load()
    packed = pack_weight(torch.randn(32, 64).bfloat16())
    if not ops.amx_linear_built():
        with pytest.raises(RuntimeError, match="built without AMX"):
            ops.amx_linear(torch.randn(2, 64).bfloat16(), packed, None, 32)
        assert not amx_usable()
        return
    with pytest.raises(RuntimeError, match="does not hold"):
        ops.amx_linear(torch.randn(2, 64).bfloat16(), packed, None, 48)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(32).bfloat16(), 32)
