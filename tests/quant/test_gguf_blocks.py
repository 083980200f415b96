"""GGUF-native layers: Q4_0/Q4_1/Q8_0 blocks taken as they are, checked against gguf-py's own
`dequantize` times x; and the loader's raw-block iterator against its float one."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from servelm.quant import get_quant_method
from servelm.quant.gguf_blocks import GGUFBlocks, cat_rows, decode_q4
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_linear import Int8Linear

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(kind, out_f=96, in_f=192, seed=0):
    w = np.random.default_rng(seed).normal(0, 0.05, (out_f, in_f)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = dequantize(raw, GGMLQuantizationType[kind])  # gguf-py's float values
    return GGUFBlocks(kind, torch.from_numpy(raw), (out_f, in_f)), torch.from_numpy(ref)


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_dequantize_like_gguf_py(kind):
    blocks, ref = _blocks(kind)
    torch.testing.assert_close(blocks.dequantize(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_codes_are_taken_as_they_are(kind):
    blocks, ref = _blocks(kind)
    q, scale, zero = decode_q4(blocks)
    rep = lambda t: t.repeat_interleave(32, dim=1)
    torch.testing.assert_close((q.float() - 8) * rep(scale) + rep(zero), ref,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_gguf_layer_equals_gguf_dequantize_times_x(kind, compute_dtype):
    method = get_quant_method("gguf")
    method.compute_dtype = compute_dtype
    blocks, ref_w = _blocks(kind)
    bias = torch.randn(96)
    layer = method.from_blocks(blocks, bias)
    assert isinstance(layer, Int8Linear if kind == "Q8_0" else Int4Linear)
    x = torch.randn(5, 192)
    ref = x @ ref_w.t() + bias
    y = layer(x)
    # Q8_0 is requantized per row (no CPU int8 op takes a scale per 32): <= max|w_row| / 254
    # more per weight; bf16 adds 2^-8 of |x| @ |W| (activation and result rounding).
    per_weight = ref_w.abs().amax(1) / 254 * 1.01 if kind == "Q8_0" else torch.zeros(96)
    slack = 1e-5 + (x.abs().sum(1, keepdim=True) * per_weight)
    if compute_dtype == torch.bfloat16:
        slack = slack + 2**-7 * (x.abs() @ ref_w.abs().t()) + 2**-8 * ref.abs()
    assert ((y - ref).abs() <= slack).all()
    if kind != "Q8_0" and compute_dtype == torch.float32:
        torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)  # no round trip: exact


def test_fused_rows_are_stacked_blocks():
    (a, wa), (b, wb) = _blocks("Q4_1", 64, 128, 1), _blocks("Q4_1", 32, 128, 2)
    fused = cat_rows([a, b])
    assert fused.shape == (96, 128)
    torch.testing.assert_close(fused.dequantize(), torch.cat([wa, wb]))
    with pytest.raises(ValueError, match="cannot fuse"):
        cat_rows([a, _blocks("Q8_0", 32, 128)[0]])


def test_loader_blocks_match_its_float_weights(default_model_path):
    from servelm.loader import load_model_config, resolve_model
    from servelm.loader.gguf_loader import (
        iter_gguf_quantized_weights,
        iter_gguf_weights,
    )

    source = resolve_model("smollm2-135m-instruct")
    config = load_model_config(source)
    wanted = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.3.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight"}
    floats = {n: t for n, t in iter_gguf_weights(source.path, config) if n in wanted}
    raw = {n: t for n, t in iter_gguf_quantized_weights(source.path, config) if n in wanted}
    assert set(raw) == wanted
    assert isinstance(raw["model.layers.0.input_layernorm.weight"], torch.Tensor)
    assert raw["model.embed_tokens.weight"].type_name == "Q8_0"
    for name in wanted - {"model.layers.0.input_layernorm.weight"}:
        assert isinstance(raw[name], GGUFBlocks), name
        # q/k rows were unpermuted on the blocks exactly as on the floats
        torch.testing.assert_close(raw[name].dequantize(), floats[name], atol=0, rtol=0)
