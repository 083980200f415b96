"""--quant-activations auto (servelm/quant/int8_act.py, QuantMethod.by_rows): a quantized
layer takes steps of fewer rows than the CPU's measured boundary with float activations and
larger ones with int8, each bit for bit the layer its activations alone would build; the
boundary comes from the CPU's dot-product path; fused parts of different GGUF types switch
together; and a GGUF K-quant file runs this way by default (servelm/loader/kquant_default.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from servelm import cpu_kernels
from servelm.quant import get_quant_method, int8_act
from servelm.quant.decode_entry import (KIND_INT4, KIND_INT4_A8, KIND_INT8, KIND_INT8_A8,
                                        KIND_KQUANT, decode_entry, forms)
from servelm.quant.gguf_blocks import GGUFBlocks
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.cpu_panels import pack_int8_panels, pack_int8_vnni, narrowest_exact
from servelm.quant.int8_linear import (Int8Linear, a8_takes_float_panels,
                                       quantize_int8_groups, quantize_int8_per_channel)
from servelm.quant.kquant_linear import KQuantLinear
from servelm.quant.mixed_linear import MixedLinear
from servelm.quant.row_parts_linear import RowPartsLinear
from servelm.quant.staged_linear import StagedLinear

cpu_kernels.load()
needs_dots = pytest.mark.skipif(not int8_act.int8_dot_usable(),
                                reason="this CPU runs neither avx512_vnni nor the AVX2 path")


@pytest.fixture(autouse=True)
def _fresh_choice():
    yield
    int8_act.set_probe_result(None)
    int8_act.set_a8_min_rows(None)


def gguf_blocks(kind: str, out_f: int, in_f: int, seed: int = 0
                ) -> tuple[GGUFBlocks, torch.Tensor]:
    """`kind` (Q8_0, Q5_0, Q4_0, Q4_1) blocks by gguf-py's quantizer, and their float values."""
    w = np.random.default_rng(seed).normal(0, 0.05, (out_f, in_f)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(out_f, in_f)
    return GGUFBlocks(kind, torch.from_numpy(raw), (out_f, in_f)), torch.from_numpy(ref)


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@needs_dots
@pytest.mark.parametrize("kind,cls,kinds", [("Q8_0", Int8Linear, (KIND_INT8, KIND_INT8_A8)),
                                            ("Q5_0", Int8Linear, (KIND_INT8, KIND_INT8_A8)),
                                            ("Q4_1", Int4Linear, (KIND_INT4, KIND_INT4_A8))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_step_takes_the_form_of_its_rows_bit_for_bit(kind, cls, kinds, dtype):
    int8_act.set_a8_min_rows(4)
    blocks, ref_w = gguf_blocks(kind, 40, 96)
    bias = torch.randn(40)
    layer = get_quant_method("gguf", "auto").from_blocks(blocks, bias)
    alone = {a: get_quant_method("gguf", a).from_blocks(blocks, bias) for a in ("float", "int8")}
    assert type(layer) is MixedLinear and layer.max_rows == 3
    assert type(layer.small) is cls and layer.small.activations == "float"
    assert type(layer.full) is cls and layer.full.activations == "int8"
    if cls is Int8Linear and a8_takes_float_panels():  # one copy of the codes for both
        assert layer.full.codes is layer.small.codes
        assert layer.full.scale32 is layer.small.scale32
        assert torch.equal(layer.full.dequantize(), alone["int8"].dequantize())
    # the decode stack's forms of the layer: the float kernel's, then the dot products'
    assert (decode_entry(forms(layer)["small"]).kind,
            decode_entry(forms(layer)["full"]).kind) == kinds
    for rows, acts in [(1, "float"), (3, "float"), (4, "int8"), (64, "int8")]:
        x = _x(rows, 96, rows).to(dtype)
        assert layer.form(x) is (layer.small if acts == "float" else layer.full)
        y = layer(x)
        assert y.dtype == dtype
        assert torch.equal(y, alone[acts](x)), (rows, acts)
        ref = x.float() @ ref_w.t() + bias
        tol = 0.03 if acts == "int8" or dtype == torch.bfloat16 else 1e-4
        assert (y.float() - ref).norm() / ref.norm() < tol, (rows, acts)


@pytest.mark.skipif(not a8_takes_float_panels(),
                    reason="the loaded int8_gemm_a8 does not read the float kernel's panels")
@pytest.mark.parametrize("m", [1, 3, 9, 64])
@pytest.mark.parametrize("n,k,group", [(40, 96, 32), (17, 100, 0), (33, 576, 32),
                                       (16, 160, 64)])
def test_int8_dot_products_read_the_float_panels_as_their_own_layout(m, n, k, group):
    """int8_gemm_a8 on the float kernel's panels ([P, K, 16] int8, each panel turned into the
    VNNI order as it goes) is the same kernel on the VNNI layout, bit for bit."""
    ops = cpu_kernels.load()
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    if group:
        q, scale = quantize_int8_groups(w, group)
    else:
        q, scale = quantize_int8_per_channel(w, torch.float32)
    panels, scale32 = pack_int8_panels(q, scale)
    x = _x(m, k, m)
    y = ops.int8_gemm_a8(x, panels, scale32, n, group)
    assert torch.equal(y, ops.int8_gemm_a8(x, pack_int8_vnni(q), scale32, n, group))
    assert torch.equal(y, ops.int8_gemm_a8(x, pack_int8_vnni(q), narrowest_exact(scale32), n,
                                           group))
    xb = x.to(torch.bfloat16)
    assert torch.equal(ops.int8_gemm_a8(xb, panels, scale32, n, group),
                       ops.int8_gemm_a8(xb, pack_int8_vnni(q), scale32, n, group))
    with pytest.raises(RuntimeError, match="N="):
        ops.int8_gemm_a8(x, panels, scale32, n + 16, group)


@needs_dots
def test_the_boundary_is_the_cpus_dot_product_paths():
    path = cpu_kernels.load().int8_dot_path()
    assert int8_act.a8_min_rows() == int8_act.A8_MIN_ROWS[path]
    rows = int8_act.A8_MIN_ROWS[path]
    assert (f"int8 from {rows}" if rows > 1 else "at every step") in int8_act.auto_reason()
    int8_act.set_a8_min_rows(1)  # int8 at every step: the one int8 layer, no float copy
    blocks, _ = gguf_blocks("Q8_0", 16, 64)
    layer = get_quant_method("gguf", "auto").from_blocks(blocks, None)
    assert type(layer) is Int8Linear and layer.activations == "int8"
    assert "every step" in int8_act.auto_reason()


def test_without_dot_products_auto_is_float_at_every_step():
    int8_act.set_probe_result(False)
    assert int8_act.a8_min_rows() is None
    assert "float activations at every step" in int8_act.auto_reason()
    blocks, _ = gguf_blocks("Q8_0", 16, 64)
    layer = get_quant_method("gguf", "auto").from_blocks(blocks, None)
    assert type(layer) is Int8Linear and layer.activations == "float"


def test_a_layer_is_never_built_with_auto_itself():
    with pytest.raises(ValueError, match="'auto' is chosen per step"):
        Int8Linear(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2), None,
                   group_size=32, activations="auto")
    with pytest.raises(ValueError, match="a8 min rows"):
        int8_act.set_a8_min_rows(0)


@needs_dots
def test_fused_parts_switch_forms_together():
    """q (Q4_K) beside k and v (Q8_0): the K-quant part runs q8_K in both forms (one layer,
    shared), the Q8_0 part float or int8 by the step's rows."""
    from test_kquant_linear import kquant_blocks

    int8_act.set_a8_min_rows(8)
    parts = [kquant_blocks("Q4_K", 32, 256, 0)[0], gguf_blocks("Q8_0", 16, 256, 1)[0],
             gguf_blocks("Q8_0", 16, 256, 2)[0]]
    layers = {}
    for acts in ("auto", "float", "int8"):
        staged = StagedLinear(256, 64, False, get_quant_method("gguf", acts))
        row = 0
        for blocks in parts:
            staged.load_blocks(blocks, row)
            row += blocks.shape[0]
        layers[acts] = staged.finalize()
    layer = layers["auto"]
    assert type(layer) is MixedLinear and layer.max_rows == 7
    small, full = layer.small, layer.full
    assert type(small) is RowPartsLinear and type(full) is RowPartsLinear
    assert type(full.parts[0]) is KQuantLinear and small.parts[0] is full.parts[0]
    assert [p.activations for p in small.parts[1:]] == ["float", "float"]
    assert [p.activations for p in full.parts[1:]] == ["int8", "int8"]
    assert decode_entry(forms(layer)["full"]).kernel_kinds == {KIND_KQUANT, KIND_INT8_A8}
    assert decode_entry(forms(layer)["small"]).kernel_kinds == {KIND_KQUANT, KIND_INT8}
    for rows, acts in [(1, "float"), (7, "float"), (8, "int8"), (40, "int8")]:
        x = _x(rows, 256, rows)
        assert torch.equal(layer(x), layers[acts](x)), (rows, acts)


def test_k_quant_file_default_takes_auto_unless_told(tmp_path, monkeypatch):
    from servelm.config import EngineArgs
    from servelm.loader import kquant_default

    monkeypatch.setattr(kquant_default, "default_method", lambda source, args: "gguf")
    source = type("Source", (), {"path": tmp_path / "m.gguf", "kind": "gguf"})()
    args = EngineArgs(model="m.gguf")
    assert args.quant_activations == "float"
    got = kquant_default.default_args(source, args)
    assert (got.quantization, got.quant_activations) == ("gguf", "auto")
    told = kquant_default.default_args(source, dataclasses.replace(args,
                                                                   quant_activations="int8"))
    assert told.quant_activations == "int8"
    det = kquant_default.default_args(source, dataclasses.replace(args, deterministic=True))
    assert det.quant_activations == "float"
    monkeypatch.setattr(kquant_default, "default_method", lambda source, args: None)
    assert kquant_default.default_args(source, args) is args
