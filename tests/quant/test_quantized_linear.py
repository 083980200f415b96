"""Each QuantizedLinear against a float reference built from its own dequantized weight, and
the round-to-nearest error bounds of int8 / int4."""

import pytest
import torch

from servelm.quant import get_quant_method, quant_method_names
from servelm.quant.int4_linear import Int4Linear, quantize_int4_groups
from servelm.quant.int8_head import Int8Head
from servelm.quant.int8_linear import Int8Linear, quantize_int8_per_channel

GEN = torch.Generator().manual_seed(0)


def _weight(out_f, in_f, outliers=True):
    w = torch.randn(out_f, in_f, generator=GEN) * 0.05
    if outliers:  # a few large weights, as real checkpoints have
        w[::7, ::13] *= 8
    return w


def _bf16_tolerance(x, layer):
    # bf16 activations and result: relative 2^-8 of |x| @ |W|^T, with slack.
    return 2**-7 * (x.abs() @ layer.dequantize().abs().t()) + 1e-6


@pytest.mark.parametrize("shape", [(64, 128), (960, 576), (100, 64)])
def test_int8_rtn_error_bound(shape):
    w = _weight(*shape)
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    # bf16 scales are rounded up: codes stay in range, error within half a (slightly larger) step
    q16, s16 = quantize_int8_per_channel(w, torch.bfloat16)
    assert (s16.float() >= w.abs().amax(1) / 127).all()
    err16 = (q16.float() * s16.float()[:, None] - w).abs()
    assert (err16 <= s16.float()[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(64, 128), (576, 576), (48, 96)])
def test_int4_rtn_error_bound(shape, group):
    w = _weight(*shape)
    q, scale, zero = quantize_int4_groups(w, group)
    assert q.dtype == torch.uint8 and q.max() <= 15
    rep = lambda t: t.repeat_interleave(group, dim=1)[:, : w.shape[1]]
    deq = (q.float() - 8) * rep(scale) + rep(zero)
    span = rep(scale) * 15  # max - min of the group
    assert ((deq - w).abs() <= rep(scale) / 2 + 1e-6 * span + 1e-7).all()


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("shape", [(128, 64), (960, 576), (40, 96)])
def test_layer_matches_its_dequantized_weight(method, shape, compute_dtype):
    m = get_quant_method(method)
    m.compute_dtype = compute_dtype
    w, bias = _weight(*shape), torch.randn(shape[0], generator=GEN)
    if method.startswith("int4") and shape[1] % 32:
        pytest.skip("int4 needs in_features divisible by 32 here")
    layer = m.from_float(w, bias)
    for t in (1, 7):
        x = torch.randn(t, shape[1], generator=GEN)
        ref = x @ layer.dequantize().t() + bias
        y = layer(x)
        assert y.shape == (t, shape[0]) and y.dtype == x.dtype
        if compute_dtype == torch.float32:
            torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        else:
            assert ((y - ref).abs() <= _bf16_tolerance(x, layer) + 2**-8 * ref.abs()).all()


def test_int4_dequantize_is_codes_times_scales():
    # Independent of the kernel: build from known codes and compare dequantize() to the formula.
    n, k, g = 48, 128, 32
    q = torch.randint(0, 16, (n, k), generator=GEN, dtype=torch.uint8)
    scale = torch.rand(n, k // g, generator=GEN) + 0.1
    zero = torch.randn(n, k // g, generator=GEN)
    layer = Int4Linear(q, scale, zero, g, None, torch.float32)
    rep = lambda t: t.repeat_interleave(g, dim=1)
    torch.testing.assert_close(layer.dequantize(), (q.float() - 8) * rep(scale) + rep(zero))
    assert layer.num_weight_bytes == n * k // 2 + 2 * 4 * n * k // g


def test_int8_bytes_are_a_quarter_of_fp32():
    q, scale = quantize_int8_per_channel(_weight(960, 576), torch.bfloat16)
    # aten keeps bf16 scales; servelm's panels float32 ones (960 rows: no padding)
    assert Int8Linear(q, scale, None, kernel="aten").num_weight_bytes == 960 * 576 + 960 * 2
    assert Int8Linear(q, scale, None, kernel="cpu").num_weight_bytes == 960 * 576 + 960 * 4


@pytest.mark.parametrize("kernel", ["aten", "cpu"])
def test_int8_head_greedy_is_exact_despite_bf16(kernel):
    # Logits that tie in bf16 but not in float32: the head must pick the true maximum.
    w = _weight(4096, 64, outliers=False)
    w[1] = w[0] * (1 + 1e-3)  # rows 0 and 1 within bf16 rounding of each other
    q, scale = quantize_int8_per_channel(w, torch.bfloat16)
    head = Int8Head(q, scale, kernel=kernel)
    x = w[0:1].clone() * 40  # makes rows 0/1 the top logits, large enough for coarse bf16
    ref = x @ head.dequantize().t()
    y = head(x)
    assert y.argmax(-1).item() == ref.argmax(-1).item()
    torch.testing.assert_close(y[0, :2], ref[0, :2], atol=1e-4, rtol=1e-5)  # the near-ties
    coarse = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, scale).float()
    assert coarse[0, 0] == coarse[0, 1]  # the case the head exists for
    if kernel == "cpu":  # float32 math on the int8 weight for every logit, not just the top
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)


def test_registry_and_the_config_name_the_same_methods():
    """EngineArgs checks --quantization against config's table (below this package): a
    method registered here but missing there could never be chosen, and the reverse fails
    only once the engine is built."""
    from servelm.config.quant_choices import QUANT_METHOD_NAMES

    assert quant_method_names() == list(QUANT_METHOD_NAMES)


def test_registry_names_and_errors():
    names = quant_method_names()
    assert {"int8", "int4", "int4-g32", "int4-g64", "int4-g128", "gguf"} <= set(names)
    with pytest.raises(ValueError, match="quantization 'int3'"):
        get_quant_method("int3")
    with pytest.raises(ValueError, match="group_size"):
        Int4Linear(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2), torch.ones(16, 2),
                   16, None)
