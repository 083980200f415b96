"""servelm's C++ int4/int8 CPU matmuls (cpu_kernels/quant_gemm.cpp) on the panel layout
(quant/cpu_panels.py): float32 math on the exact dequantized weight, for every tile path
(M = 1, 2, 4, 8 rows of x and their remainders), a last panel cut short by N, groups of
32..256 (a last group cut short by K), bf16 and float32 scales; and the layers' choice of
kernel."""

from __future__ import annotations

import pytest
import torch

from servelm.quant import cpu_panels
from servelm.quant.cpu_panels import (pack_int4_panels, pack_int8_panels, unpack_int4_panels,
                                      unpack_int8_panels)
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_linear import Int8Linear, quantize_int8_groups
from servelm.quant.quantized_weight import QuantizedWeight

GEN = torch.Generator().manual_seed(7)


@pytest.fixture(scope="module")
def ops():
    return cpu_panels.panel_ops(required=True)


def _int4_case(n, k, group, sz_dtype):
    g = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=GEN, dtype=torch.uint8)
    scale = (torch.rand(n, g, generator=GEN) * 0.05 + 1e-3).to(sz_dtype)
    zero = (torch.randn(n, g, generator=GEN) * 0.02).to(sz_dtype)
    rep = lambda t: t.double().repeat_interleave(group, dim=1)[:, :k]
    return q, scale, zero, (q.double() - 8) * rep(scale) + rep(zero)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (40, 96, 32), (100, 576, 128),
                                       (33, 320, 256), (16, 1536, 64)])
@pytest.mark.parametrize("sz_dtype", [torch.bfloat16, torch.float32])
def test_int4_gemm_is_float32_math_on_the_dequantized_weight(ops, m, n, k, group, sz_dtype):
    q, scale, zero, w = _int4_case(n, k, group, sz_dtype)
    codes, sz = pack_int4_panels(q, scale, zero, sz_dtype)
    assert codes.shape == (-(-n // 16), k // 2, 16) and sz.dtype == sz_dtype
    torch.testing.assert_close(unpack_int4_panels(codes, sz, n, group).double(), w)
    x = torch.randn(m, k, generator=GEN)
    ref = x.double() @ w.t()
    y = ops.int4_gemm(x, codes, sz, n, group)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 rounding in a different order: ~1e-7 of the terms' magnitude per output
    bound = 1e-6 * (x.double().abs() @ w.abs().t()) + 1e-7
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 64])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 97), (100, 576), (7, 3)])
@pytest.mark.parametrize("group", [0, 32, 64])
def test_int8_gemm_is_float32_math_on_the_dequantized_weight(ops, m, n, k, group):
    """group 0: a scale per row; else a scale per `group` inputs (a last group cut short)."""
    q = torch.randint(-127, 128, (n, k), generator=GEN, dtype=torch.int8)
    num_groups = -(-k // group) if group else 1
    scale = torch.rand(n, num_groups, generator=GEN) * 0.01 + 1e-4
    if not group:
        scale = scale[:, 0]
    codes, scale32 = pack_int8_panels(q, scale)
    assert torch.equal(unpack_int8_panels(codes, n), q)
    x = torch.randn(m, k, generator=GEN)
    per_col = (scale.double().repeat_interleave(group, dim=1)[:, :k] if group
               else scale.double()[:, None])
    w = q.double() * per_col
    y = ops.int8_gemm(x, codes, scale32, n, group)
    bound = 1e-6 * (x.double().abs() @ w.abs().t()) + 1e-7
    assert y.shape == (m, n) and ((y.double() - x.double() @ w.t()).abs() <= bound).all()


def test_int8_groups_give_back_q8_0_exactly():
    """RTN per 32 on Q8_0's dequantized values returns its codes and (fp16) scales: each
    block's largest code is 127, as ggml's quantizer makes it."""
    n, k = 24, 96
    q = torch.randint(-127, 128, (n, k), generator=GEN, dtype=torch.int8)
    q.view(n, k // 32, 32)[..., 5] = 127  # ggml: the block's max |x| maps to +-127
    q.view(n, k // 32, 32)[0, 1, 5] = -127
    d = (torch.rand(n, k // 32, generator=GEN) * 0.01 + 1e-4).half().float()
    w = q.float() * d.repeat_interleave(32, dim=1)
    q2, d2 = quantize_int8_groups(w, 32)
    assert torch.equal(q2, q) and torch.equal(d2, d)
    weight = QuantizedWeight("int8", q, d, None, 32).validate()
    assert weight.type_name == "int8-g32" and torch.equal(weight.dequantize(), w)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight("int8", q, d[:, :1], None, 32).validate()


def test_grouped_int8_layer_on_each_kernel():
    """The C++ kernel keeps the group scales; aten's op takes one per row, so the layer
    requantizes (RTN per row of the grouped weight: within half a row step)."""
    n, k = 40, 96
    w = torch.randn(n, k, generator=GEN) * torch.linspace(0.01, 1.0, k)  # uneven columns
    q, d = quantize_int8_groups(w, 32)
    grouped = q.float() * d.repeat_interleave(32, dim=1)
    x = torch.randn(3, k, generator=GEN)
    cpu = Int8Linear(q, d, None, kernel="cpu", group_size=32)
    assert cpu.group_size == 32 and torch.equal(cpu.dequantize(), grouped)
    torch.testing.assert_close(cpu(x), x @ grouped.t(), atol=1e-5, rtol=1e-5)
    aten = Int8Linear(q, d, None, torch.float32, kernel="aten", group_size=32)
    assert aten.group_size == 0 and aten.scale.shape == (n,)
    step = grouped.abs().amax(1, keepdim=True) / 127
    assert ((aten.dequantize() - grouped).abs() <= step / 2 + 1e-7).all()


def test_kernels_reject_bad_operands(ops):
    q, scale, zero, _ = _int4_case(32, 64, 32, torch.bfloat16)
    codes, sz = pack_int4_panels(q, scale, zero)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ops.int4_gemm(x.double(), codes, sz, 32, 32)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        ops.int4_gemm(torch.randn(2, 32), codes, sz, 32, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.int4_gemm(x, codes, sz, 33, 32)
    with pytest.raises(RuntimeError, match="sz must be"):
        ops.int4_gemm(x, codes, sz[:, :1].contiguous(), 32, 32)
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_int4_panels(q[:, :48], scale, zero)
    c8, s8 = pack_int8_panels(torch.zeros(20, 8, dtype=torch.int8), torch.ones(20))
    with pytest.raises(RuntimeError, match="share|codes"):
        ops.int8_gemm(torch.randn(1, 9), c8, s8, 20)


@pytest.mark.parametrize("n,k,group", [(40, 100, 32), (64, 130, 128), (48, 576, 64)])
def test_int4_layer_cpu_and_aten_kernels_agree(n, k, group):
    """Same codes, both CPU kernels: panels (float32 activations) and aten (in float32 here),
    in_features padded to 32 / to the group."""
    g = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=GEN, dtype=torch.uint8)
    scale, zero = torch.rand(n, g, generator=GEN) * 0.05, torch.randn(n, g, generator=GEN) * 0.02
    bias = torch.randn(n, generator=GEN)
    cpu = Int4Linear(q, scale, zero, group, bias, torch.float32, kernel="cpu")
    aten = Int4Linear(q, scale, zero, group, bias, torch.float32, kernel="aten")
    # aten reads its weight back through its op: the same values up to float32 rounding
    torch.testing.assert_close(cpu.dequantize(), aten.dequantize(), atol=1e-7, rtol=1e-6)
    x = torch.randn(5, k, generator=GEN)
    torch.testing.assert_close(cpu(x), aten(x), atol=1e-5, rtol=1e-5)
    assert cpu(x.bfloat16()).dtype == torch.bfloat16  # x's dtype in, x's dtype out


def test_layers_pick_the_panels_unless_told_otherwise(cpu_kernel_mode):
    q = torch.randint(0, 16, (32, 64), generator=GEN, dtype=torch.uint8)
    s = torch.rand(32, 2, generator=GEN)
    q8 = torch.randint(-127, 128, (32, 64), generator=GEN, dtype=torch.int8)
    cpu_kernel_mode(cpu_panels.PART, "auto")
    assert Int4Linear(q, s, s, 32, None).kernel == "cpu"
    assert Int8Linear(q8, s[:, 0], None).kernel == "cpu"
    cpu_kernel_mode(cpu_panels.PART, "torch")
    assert Int4Linear(q, s, s, 32, None).kernel == "aten"
    assert Int8Linear(q8, s[:, 0], None).kernel is None  # aten on the CPU, by x's device
    with pytest.raises(ValueError, match="quant=torch"):
        Int4Linear(q, s, s, 32, None, kernel="cpu")
