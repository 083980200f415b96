"""GGUF K-quants kept as codes: servelm's kquant kernels against gguf-py's own `dequantize`,
KQuantLinear and `--quantization gguf`'s layers on them, Q5_0 as exact int8 codes, and fused
layers whose GGUF parts differ in type (a Q4_K_M file's q/k beside its v).

gguf-py quantizes none of the K-quants, so their blocks are built from the documented layout:
random bytes for codes and packed scales (every byte pattern is a valid block) and small
float16 super-block scales; gguf-py's dequantize then says what they stand for."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from servelm import cpu_kernels
from servelm.quant import get_quant_method
from servelm.quant.gguf_blocks import GGUFBlocks, decode_q5_0
from servelm.quant.int8_linear import Int8Linear
from servelm.quant.kquant_linear import KQUANT_TYPES, KQuantLinear
from servelm.quant.row_parts_linear import RowPartsLinear
from servelm.quant.staged_linear import StagedLinear

KQUANTS = sorted(KQUANT_TYPES)


def kquant_blocks(kind: str, out_f: int, in_f: int, seed: int = 0
                  ) -> tuple[GGUFBlocks, torch.Tensor]:
    """Random `kind` rows [out_f, in_f / 256 super-blocks] and gguf-py's float values."""
    rng = np.random.default_rng(seed)
    per_row, block_bytes = in_f // 256, KQUANT_TYPES[kind][1]
    raw = rng.integers(0, 256, (out_f, per_row, block_bytes), dtype=np.uint8)

    def f16(scale):
        values = rng.uniform(0.2, 1.0, (out_f, per_row)) * scale
        return values.astype(np.float16).view(np.uint8).reshape(out_f, per_row, 2)

    if kind == "Q6_K":
        raw[..., 208:210] = f16(2e-3)  # ... | scales int8 x16 | d
    else:
        raw[..., 0:2], raw[..., 2:4] = f16(2e-3), f16(2e-3)  # d | dmin | ...
    raw = raw.reshape(out_f, per_row * block_bytes)
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(out_f, in_f)
    return GGUFBlocks(kind, torch.from_numpy(raw), (out_f, in_f)), torch.from_numpy(ref)


@pytest.fixture(scope="module")
def ops():
    return cpu_kernels.load()


def rounded_rows(ops, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: q8_K, int8 codes times one scale per 256 columns."""
    q, d, bsum = ops.kquant_quantize_act(x)
    m, k = x.shape
    assert torch.equal(bsum, q.view(m, -1, 16).sum(-1).to(torch.int16))
    assert (q.float().abs().amax(-1) <= 127).all()
    return (q.float().view(m, -1, 256) * d[..., None]).view(m, k)


@pytest.mark.parametrize("kind", KQUANTS)
def test_kernel_dequantizes_like_gguf_py(ops, kind):
    blocks, ref = kquant_blocks(kind, 40, 768)
    kind_id = KQUANT_TYPES[kind][0]
    w = ops.kquant_dequant(blocks.data, kind_id, 40, torch.float32)
    assert torch.equal(w, ref)  # the same float32 operations, in gguf-py's order
    torch.testing.assert_close(ops.kquant_dequant(blocks.data, kind_id, 40, torch.bfloat16),
                               ref.bfloat16())
    assert torch.equal(blocks.dequantize(), ref)


@pytest.mark.parametrize("kind", KQUANTS)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 43])
def test_kernel_is_gguf_py_weights_times_the_rounded_rows(ops, kind, rows):
    # 37 weight rows: two whole panels of 16 and a partial one; 9+ rows: the panels kernel
    # where it is built (avx512_vnni), below it the rows kernel
    blocks, ref_w = kquant_blocks(kind, 37, 512, seed=rows)
    x = torch.randn(rows, 512) * torch.linspace(0.1, 4, 512)  # unequal column ranges
    y = ops.kquant_gemm(x, blocks.data, KQUANT_TYPES[kind][0], 37)
    exact = rounded_rows(ops, x).double() @ ref_w.double().t()
    # integer dot products, float32 scales: one rounding per super-block, not per weight
    assert ((y.double() - exact).abs() <= 1e-5 * exact.abs().amax()).all()
    # and near the unrounded product (q8_K's rounding: half a step of max|x| / 127)
    full = x.double() @ ref_w.double().t()
    assert ((y.double() - full).abs() <= 0.03 * full.abs().amax()).all()


@pytest.mark.parametrize("kind", KQUANTS)
def test_a_rows_output_is_the_same_whatever_the_steps_other_rows(ops, kind):
    """One row alone (the rows kernel), among 8 or among 40 (the panels where built): the
    same operations, so the same bits."""
    blocks, _ = kquant_blocks(kind, 50, 768, seed=5)
    x = torch.randn(40, 768)
    kind_id = KQUANT_TYPES[kind][0]
    whole = ops.kquant_gemm(x, blocks.data, kind_id, 50)
    for i in (0, 13, 39):
        assert torch.equal(ops.kquant_gemm(x[i:i + 1], blocks.data, kind_id, 50)[0], whole[i])
    assert torch.equal(ops.kquant_gemm(x[3:11], blocks.data, kind_id, 50), whole[3:11])
    assert torch.equal(ops.kquant_gemm(x[5:8], blocks.data, kind_id, 50), whole[5:8])


def test_rows_round_to_q8_k_half_to_even(ops):
    x = torch.randn(3, 512) * 3
    x[1, :256] = 0  # an all-zero super-block: d = 0, codes 0
    q, d, _ = ops.kquant_quantize_act(x)
    blocks = x.view(3, 2, 256)
    assert torch.equal(d, blocks.abs().amax(-1) / 127)
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    assert torch.equal(q.view(3, 2, 256).float(), torch.round(blocks * inv[..., None]))
    assert (q[1, :256] == 0).all() and d[1, 0] == 0
    q16, d16, _ = ops.kquant_quantize_act(x.bfloat16())  # bfloat16 rows widen exactly
    q32, d32, _ = ops.kquant_quantize_act(x.bfloat16().float())
    assert torch.equal(q16, q32) and torch.equal(d16, d32)


def test_kernel_takes_bfloat16_rows_and_answers_in_them(ops):
    blocks, _ = kquant_blocks("Q4_K", 16, 256)
    x = torch.randn(2, 256)
    y = ops.kquant_gemm(x.bfloat16(), blocks.data, 12, 16)
    assert y.dtype == torch.bfloat16
    ref = ops.kquant_gemm(x.bfloat16().float(), blocks.data, 12, 16)
    torch.testing.assert_close(y, ref.bfloat16())


def test_kernel_refuses_codes_that_do_not_fit(ops):
    blocks, _ = kquant_blocks("Q5_K", 8, 256)
    with pytest.raises(RuntimeError, match="super-blocks"):
        ops.kquant_gemm(torch.randn(1, 256), blocks.data[:, :100].contiguous(), 13, 8)
    with pytest.raises(RuntimeError, match="not a supported K-quant"):
        ops.kquant_gemm(torch.randn(1, 256), blocks.data, 11, 8)
    with pytest.raises(RuntimeError, match="columns"):
        ops.kquant_gemm(torch.randn(1, 512), blocks.data, 13, 8)


@pytest.mark.parametrize("kind", KQUANTS)
def test_layer_few_rows_round_x_many_rows_do_not(kind):
    blocks, ref_w = kquant_blocks(kind, 48, 512, seed=3)
    bias = torch.randn(48)
    layer = KQuantLinear(kind, blocks.data, blocks.shape, bias, max_int8_rows=4)
    assert layer.num_weight_bytes == blocks.data.numel()  # the file's bytes, nothing more
    assert torch.equal(layer.dequantize(), ref_w)
    x = torch.randn(2, 3, 512)
    ref = x @ ref_w.t() + bias
    y = layer(x)  # 6 rows > 4: the dequantized weight, float32 activations
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    small = layer(x[0])  # 3 rows: int8 activations, so not the float product
    assert not torch.equal(small, y[0])
    assert ((small - ref[0]).abs() <= 0.03 * ref[0].abs().amax()).all()


def test_layer_refuses_a_shape_the_codes_do_not_fit():
    blocks, _ = kquant_blocks("Q6_K", 8, 256)
    with pytest.raises(ValueError, match="do not fit shape"):
        KQuantLinear("Q6_K", blocks.data, (8, 512), None)
    with pytest.raises(ValueError, match="type_name"):
        KQuantLinear("Q8_0", blocks.data, (8, 256), None)


@pytest.mark.parametrize("kind", KQUANTS)
def test_gguf_method_keeps_k_quants_as_codes(kind):
    blocks, ref_w = kquant_blocks(kind, 32, 256)
    layer = get_quant_method("gguf").from_blocks(blocks, None)
    assert isinstance(layer, KQuantLinear) and layer.type_name == kind
    assert torch.equal(layer.codes, blocks.data)


def test_without_the_kernels_k_quants_are_their_float_values(cpu_kernel_mode):
    cpu_kernel_mode("quant", "torch")
    blocks, ref_w = kquant_blocks("Q4_K", 32, 256)
    layer = get_quant_method("gguf").from_blocks(blocks, None)
    assert type(layer) is nn.Linear and torch.equal(layer.weight, ref_w)


def test_q5_0_is_int8_codes_exactly():
    w = np.random.default_rng(1).normal(0, 0.05, (24, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q5_0)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q5_0))
    blocks = GGUFBlocks("Q5_0", torch.from_numpy(raw), (24, 96))
    q, d = decode_q5_0(blocks)
    assert q.min() >= -16 and q.max() <= 15
    assert torch.equal(blocks.dequantize(), ref)
    layer = get_quant_method("gguf").from_blocks(blocks, None)
    assert isinstance(layer, Int8Linear) and layer.group_size == 32
    assert torch.equal(layer.dequantize(), ref)


def test_fused_parts_of_different_types_keep_their_own():
    """q (Q4_K), k (Q4_K) and v (Q6_K) into one qkv layer: each part keeps its codes."""
    parts = [kquant_blocks("Q4_K", 32, 256, 0), kquant_blocks("Q4_K", 16, 256, 1),
             kquant_blocks("Q6_K", 16, 256, 2)]
    staged = StagedLinear(256, 64, True, get_quant_method("gguf"))
    staged.bias.data.copy_(torch.randn(64))
    row = 0
    for blocks, _ in parts:
        staged.load_blocks(blocks, row)
        row += blocks.shape[0]
    layer = staged.finalize()
    assert isinstance(layer, RowPartsLinear)
    assert [p.type_name for p in layer.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    ref_w = torch.cat([w for _, w in parts])
    assert torch.equal(layer.dequantize(), ref_w)
    x = torch.randn(160, 256)
    y, ref = layer(x), x @ ref_w.t() + staged.bias
    assert torch.equal(y, torch.cat([p(x) for p in layer.parts], dim=-1))  # biases in parts
    assert ((y - ref).abs() <= 0.03 * ref.abs().amax()).all()  # q8_K's rounding of x


def test_same_type_parts_still_fuse_into_one_layer():
    parts = [kquant_blocks("Q5_K", 16, 256, s) for s in (0, 1)]
    staged = StagedLinear(256, 32, False, get_quant_method("gguf"))
    staged.load_blocks(parts[0][0], 0)
    staged.load_blocks(parts[1][0], 16)
    layer = staged.finalize()
    assert isinstance(layer, KQuantLinear)
    assert torch.equal(layer.dequantize(), torch.cat([w for _, w in parts]))
