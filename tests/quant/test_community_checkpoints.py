"""GPTQ, AWQ and compressed-tensors checkpoints load into servelm's int4 / int8 layers.

Each tiny Llama-shaped checkpoint must give the logits of transformers running its
dequantized weights (the reference, community_checkpoints.py) and the same greedy tokens,
with its linears built from the codes (no float round trip: the RTN quantizers are made to
raise) where servelm's layers hold them exactly; act-order GPTQ and asymmetric 8-bit layers
stay float, and so does the lm_head.
"""

import json

import pytest
import torch
from torch import nn

import community_checkpoints as cc
from tiny_models import greedy, make_tiny_hf_model, prefill_logits
from servelm.config import EngineArgs
from servelm.engine_builder import build_engine
from servelm.protocol import InvalidParameterError
from servelm.quant import methods
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.int8_linear import Int8Linear

PROMPT = [5, 17, 99, 3, 250, 11, 42, 8, 8, 301, 77, 2]


def _hf(arch="llama", **kw):
    # 128-wide inputs (256 for down_proj): groups of 32, 64 and 128 all split a row
    return make_tiny_hf_model(arch, hidden_size=128, intermediate_size=256, **kw)


def _engine(path, **kw):
    return build_engine(EngineArgs(model=str(path), num_blocks=64, block_size=4,
                                   dtype="float32", **kw))


def _reference_logits(ref, prompt=PROMPT):
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0].float()


def _reference_greedy(ref, prompt, n=12):
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def no_requantizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a community checkpoint's codes were requantized")

    monkeypatch.setattr(methods, "quantize_int8_per_channel", refuse)
    monkeypatch.setattr(methods, "quantize_int4_groups", refuse)


def _check(path, ref, kinds, **engine_kw):
    engine = _engine(path, **engine_kw)
    model = engine.runner.model
    layer = model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj]
    assert {type(m) for m in linears} == kinds, [type(m) for m in linears]
    assert type(model.lm_head) is nn.Linear  # left float, as its publisher did
    got, want = prefill_logits(engine, PROMPT), _reference_logits(ref)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-5, err
    assert greedy(engine, PROMPT, 12) == _reference_greedy(ref, PROMPT)
    return engine


@pytest.mark.parametrize("bits,group,sym,v1", [
    (4, 128, True, True), (4, 32, False, True), (4, 64, False, False), (4, -1, True, True),
    (8, 128, True, True), (8, -1, True, False)])
def test_gptq_codes_load_into_int_layers(bits, group, sym, v1, tmp_path, no_requantizing):
    ref = cc.write_gptq(_hf(), tmp_path / "m", bits, group, sym, act_order=False, v1=v1)
    kind = Int4Linear if bits == 4 else Int8Linear
    engine = _check(tmp_path / "m", ref, {kind})
    assert engine.engine_args.quantization == "gptq"


def test_gptq_v1_zero_point_off_by_one(tmp_path):
    """A stored zero point of 15 reads as 16 in the original format: a group whose smallest
    weight is 0 (zero point 0, stored as -1) dequantizes to (q - 16) s, as every GPTQ kernel
    computes it; servelm follows."""
    hf = _hf()
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight.abs_()  # every group's min >= 0: zero 0
    ref = cc.write_gptq(hf, tmp_path / "m", 4, 32, sym=False, v1=True)
    t = cc.gptq_tensors(hf.model.layers[0].mlp.down_proj.weight.detach(), 4, 32, False,
                        False, True)
    assert bool(((t["qzeros"] & 0xF) == 0xF).all())  # stored -1: the v1 convention's 16
    _check(tmp_path / "m", ref, {Int4Linear})


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order_keeps_codes_with_a_perm(bits, tmp_path, no_requantizing):
    """Act-order's scattered groups: the codes sorted by group once at load, the activations
    gathered into that order per call; q/k/v (gate/up) share their input's order and fuse."""
    from servelm.quant.permuted_linear import PermutedLinear

    ref = cc.write_gptq(_hf(), tmp_path / "m", bits, 32, sym=bits == 8, act_order=True)
    engine = _check(tmp_path / "m", ref, {PermutedLinear})
    layer = engine.runner.model.layers[1]
    kind = Int4Linear if bits == 4 else Int8Linear
    assert type(layer.mlp.down_proj.inner) is kind
    want = ref.model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(layer.mlp.down_proj.dequantize(), want)


def test_gptq_act_order_orders_that_differ_within_a_fused_layer_go_float(tmp_path):
    """q, k and v each in its own column order cannot share one gather: that fused layer
    is built from the exact float values; o_proj and down_proj keep their codes."""
    from servelm.quant.permuted_linear import PermutedLinear

    ref = cc.write_gptq(_hf(), tmp_path / "m", 4, 32, sym=False, act_order=True,
                        shared_order=False)
    engine = _engine(tmp_path / "m")
    layer = engine.runner.model.layers[0]
    assert type(layer.self_attn.qkv_proj) is nn.Linear
    assert type(layer.self_attn.o_proj) is PermutedLinear
    got, want = prefill_logits(engine, PROMPT), _reference_logits(ref)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_gptq_act_order_with_one_group_a_row_keeps_codes(tmp_path, no_requantizing):
    ref = cc.write_gptq(_hf(), tmp_path / "m", 4, -1, sym=True, act_order=True)
    _check(tmp_path / "m", ref, {Int4Linear})


def test_gptq_asymmetric_8bit_is_float(tmp_path):
    ref = cc.write_gptq(_hf(), tmp_path / "m", 8, 64, sym=False)
    _check(tmp_path / "m", ref, {nn.Linear})


@pytest.mark.parametrize("group", [32, 128, -1])
def test_awq_gemm_codes_load_into_int4(group, tmp_path, no_requantizing):
    ref = cc.write_awq(_hf(), tmp_path / "m", group)
    engine = _check(tmp_path / "m", ref, {Int4Linear})
    assert engine.engine_args.quantization == "awq"


@pytest.mark.parametrize("strategy,group,symmetric", [("group", 32, True),
                                                      ("group", 64, False),
                                                      ("channel", 0, True)])
def test_compressed_tensors_w4a16(strategy, group, symmetric, tmp_path, no_requantizing):
    pytest.importorskip("compressed_tensors")
    ref = cc.write_compressed_tensors(_hf(), tmp_path / "m", 4, strategy, group, symmetric)
    qc = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    engine = _check(tmp_path / "m", ref, {Int4Linear})
    assert engine.engine_args.quantization == "compressed-tensors"


def test_compressed_tensors_w8a8(tmp_path, no_requantizing):
    """int8 weights with a scale per channel; the per-token activation scheme is read past
    (float activations: the reference is transformers' decompressed float model)."""
    pytest.importorskip("compressed_tensors")
    ref = cc.write_compressed_tensors(_hf(), tmp_path / "m", 8, "channel", 0, True,
                                      activations=True)
    qc = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    _check(tmp_path / "m", ref, {Int8Linear})


def test_qwen2_gptq_keeps_its_biases(tmp_path, no_requantizing):
    ref = cc.write_gptq(_hf("qwen2"), tmp_path / "m", 4, 32, sym=False)
    _check(tmp_path / "m", ref, {Int4Linear})


# -- refusals ------------------------------------------------------------------------------


def _with_config(tmp_path, qc):
    ref = cc.write_gptq(_hf(), tmp_path / "m", 4, 128)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["'bitsandbytes'", "NF4"]),
    ({"quant_method": "hqq"}, ["'hqq'", "HQQ"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["bits 3", "2- and 3-bit"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128,
      "checkpoint_format": "marlin"}, ["checkpoint_format 'marlin'"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     ["version 'gemv'"]),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {}}, ["format 'float-quantized'"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}},
     ["weights.type 'float'"]),
])
def test_other_formats_are_refused_by_name(qc, words, tmp_path):
    _with_config(tmp_path, qc)
    with pytest.raises(InvalidParameterError) as e:
        _engine(tmp_path / "m")
    assert e.value.param == "model"
    for word in words:
        assert word in str(e.value), str(e.value)


def test_group_size_servelm_cannot_hold_is_refused(tmp_path):
    cc.write_gptq(_hf(), tmp_path / "m", 4, 16)
    with pytest.raises(ValueError, match="group_size 16"):
        _engine(tmp_path / "m")


def test_codes_methods_need_such_a_checkpoint(tmp_path):
    from tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint(_hf(), tmp_path / "f")
    with pytest.raises(InvalidParameterError, match="not one") as e:
        _engine(tmp_path / "f", quantization="gptq")
    assert e.value.param == "quantization"
    cc.write_awq(_hf(), tmp_path / "a", 128)
    with pytest.raises(InvalidParameterError, match="is a awq checkpoint") as e:
        _engine(tmp_path / "a", quantization="gptq")
    assert e.value.param == "quantization"


# -- MoE -----------------------------------------------------------------------------------


def test_gptq_moe_experts_hold_the_checkpoint_codes(tmp_path):
    """A tiny Qwen3-MoE GPTQ checkpoint: every routed expert and attention linear is an
    int4 layer holding exactly the checkpoint's weights. Where the family's model takes
    the checkpoint's own method the logits are the dequantized model's; where it takes only
    the registered int4-gN (the lm_head then int8), within that head's rounding."""
    from tiny_families import make_tiny_family_model

    hf = make_tiny_family_model("qwen3_moe", hidden_size=128, intermediate_size=256)
    ref = cc.write_gptq(hf, tmp_path / "m", 4, 32, sym=False)
    engine = _engine(tmp_path / "m")
    model = engine.runner.model
    experts = model.layers[1].mlp.experts
    ref_experts = ref.model.layers[1].mlp.experts
    for e in (0, 5):
        gate_up = experts.q13[e]
        assert type(gate_up) is Int4Linear
        assert torch.equal(gate_up.dequantize(), ref_experts.gate_up_proj[e].detach())
        assert torch.equal(experts.q2[e].dequantize(), ref_experts.down_proj[e].detach())
    assert type(model.layers[0].self_attn.qkv_proj) is Int4Linear
    got, want = prefill_logits(engine, PROMPT), _reference_logits(ref)
    err = ((got - want).norm() / want.norm()).item()
    exact = engine.engine_args.quantization == "gptq"
    assert err < (1e-5 if exact else 2e-2), (engine.engine_args.quantization, err)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= (1.0 if exact else 0.9), agree


def test_autogptq_quantize_config_json_beside_the_config(tmp_path, no_requantizing):
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json, not in
    config.json's quantization_config."""
    ref = cc.write_gptq(_hf(), tmp_path / "m", 4, 64, sym=False)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc.pop("quant_method"), qc.pop("checkpoint_format")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "m" / "quantize_config.json").write_text(json.dumps(qc))
    _check(tmp_path / "m", ref, {Int4Linear})


def test_gptq_8bit_under_int8_activations(tmp_path):
    """Symmetric 8-bit codes span -128..127 once centred; the int8-activation kernel takes
    -128 as it takes the other codes: its output is its integer math on them, exactly."""
    from servelm.quant.int8_act import int8_dot_usable

    if not int8_dot_usable():
        pytest.skip("no int8 dot products on this CPU")
    hf = _hf()
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.weight[:, 0] = -1.0  # each row's min: code 0
    cc.write_gptq(hf, tmp_path / "m", 8, -1, sym=True)
    engine = _engine(tmp_path / "m", quant_activations="int8")
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is Int8Linear and qkv.activations == "int8"
    codes = qkv.codes_int8()
    assert int(codes.min()) == -128
    # the kernel's integer math in float64: x per 32 columns to int8 (d = max|x| / 127,
    # round half to even), integer dots with the codes, times d and the row's scale
    x = torch.randn(3, qkv.in_features)
    xg = x.double().view(3, -1, 32)
    d = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xg / d)
    dots = torch.einsum("tgk,ngk->tng", xq, codes.double().view(codes.shape[0], -1, 32))
    want = (dots * d.squeeze(-1)[:, None, :]).sum(-1) * qkv.scale.double()
    torch.testing.assert_close(qkv(x).double(), want, rtol=1e-5, atol=1e-5)


def test_compressed_tensors_mixed_precision_reads_each_groups_format(tmp_path):
    """A top-level format "mixed-precision" defers to the config groups' own formats: a
    group in a refused format is still refused by name."""
    pytest.importorskip("compressed_tensors")
    ref = cc.write_compressed_tensors(_hf(), tmp_path / "m", 4, "group", 32, True)
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    qc = cfg["quantization_config"]
    qc["format"] = "mixed-precision"
    qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    path.write_text(json.dumps(cfg))
    _check(tmp_path / "m", ref, {Int4Linear})
    qc["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    path.write_text(json.dumps(cfg))
    with pytest.raises(InvalidParameterError, match="format 'nvfp4-pack-quantized'"):
        _engine(tmp_path / "m")


def test_dtype_auto_reads_the_checkpoints_method(tmp_path):
    """A GPTQ checkpoint stored in bfloat16 runs float32 under --dtype auto, as every
    quantized build with float activations (its kernels take float32 rows)."""
    cc.write_gptq(_hf(), tmp_path / "m", 4, 128)
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(cfg))
    engine = build_engine(EngineArgs(model=str(tmp_path / "m"), num_blocks=16, block_size=4))
    assert engine.engine_args.dtype == "float32"
    assert engine.engine_args.quantization == "gptq"


def test_servelm_quantize_refuses_a_gptq_checkpoint(tmp_path):
    from servelm.quant_tools.quantize import quantize_checkpoint

    cc.write_gptq(_hf(), tmp_path / "m", 4, 128)
    with pytest.raises(InvalidParameterError, match="already a quantized") as e:
        quantize_checkpoint(str(tmp_path / "m"), "int8", tmp_path / "out")
    assert e.value.param == "model"
