"""Float32 linears in two forms (layers/linear.py, pair_with_panels): steps of few rows on
servelm's panel GEMM (DetLinear's kernel), steps of many on oneDNN's packed GEMM. Both forms
compute the layer's matmul; the engine pairs a float32 model's linears where the CPU has a
measured row count (`--cpu-kernels gemm`), the decode stack takes the few-row form, and the
option turns it off or insists on it."""

import logging

import pytest
import torch
from torch import nn

from servelm.layers.det_linear import DetLinear, det_linear_calls
from servelm.layers.linear import (PackedLinear, can_pack, float_weight_bytes,
                                   pair_with_panels, panel_rows)
from servelm.quant.mixed_linear import MixedLinear
from tiny_models import greedy, prefill_logits

pytestmark = pytest.mark.skipif(
    panel_rows() == 0 or not can_pack(torch.device("cpu"), torch.float32),
    reason="no AVX2 panel GEMM or no oneDNN on this CPU")


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16, bias=False)
        self.lm_head = None  # tied to the embedding


def test_every_float_linear_and_a_tied_head_get_both_forms():
    torch.manual_seed(0)
    model = _Tiny()
    x_few, x_many = torch.randn(3, 16), torch.randn(40, 16)
    want = {n: model.out(model.proj(x)) for n, x in (("few", x_few), ("many", x_many))}
    head = {n: x @ model.embed_tokens.weight.t() for n, x in (("few", x_few),
                                                                ("many", x_many))}
    assert float_weight_bytes(model) == 4 * (16 * 32 + 32 * 16 + 50 * 16)
    assert pair_with_panels(model, max_rows=8) == 3
    for layer in (model.proj, model.out, model.lm_head):
        assert type(layer) is MixedLinear and layer.max_rows == 8
        assert type(layer.full) is PackedLinear and type(layer.small) is DetLinear
    calls = det_linear_calls()
    got_many = model.out(model.proj(x_many))
    assert det_linear_calls() == calls  # 40 rows: oneDNN's form
    got_few = model.out(model.proj(x_few))
    assert det_linear_calls() == calls + 2  # 3 rows: the panels
    torch.testing.assert_close(got_few, want["few"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_many, want["many"], rtol=1e-5, atol=1e-5)
    for n, x in (("few", x_few), ("many", x_many)):
        torch.testing.assert_close(model.lm_head(x), head[n], rtol=1e-5, atol=1e-5)


def _engine(tiny_hf, tiny_engine, caplog, option):
    hf = tiny_hf("llama")
    with caplog.at_level(logging.INFO, logger="servelm.engine_builder"):
        engine = tiny_engine(hf, cpu_kernels=option)
    paths = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels")]
    caplog.clear()
    return hf, engine, paths[0]


def test_a_float32_engine_decodes_on_the_panels_and_matches_onednn_alone(
        tiny_hf, tiny_engine, caplog):
    hf, paired, log = _engine(tiny_hf, tiny_engine, caplog, "auto")
    assert log.endswith(f"gemm=panels<={panel_rows()}+onednn")
    mixed = [m for m in paired.runner.model.modules() if type(m) is MixedLinear]
    assert len(mixed) == 2 * 4 + 1  # qkv, o, gate_up, down a layer; the untied head
    _, plain, log = _engine(tiny_hf, tiny_engine, caplog, "gemm=torch")
    assert log.endswith("gemm=onednn")
    assert not any(type(m) is MixedLinear for m in plain.runner.model.modules())

    prompt = [int(t) for t in torch.randint(0, 384, (120,), generator=torch.Generator()
                                            .manual_seed(3))]
    calls = det_linear_calls()
    tokens = greedy(paired, prompt[:20], 12)
    assert det_linear_calls() > calls
    assert "small" in paired.runner.cpu_stack._stacks  # decode steps: the stack's panel form
    assert tokens == greedy(plain, prompt[:20], 12)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    for engine in (paired, plain):  # 120 rows: oneDNN; 10: the panels
        torch.testing.assert_close(prefill_logits(engine, prompt), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prefill_logits(engine, prompt[:10]), want[:10],
                                   rtol=1e-4, atol=1e-4)


def test_the_pairing_steps_aside_or_refuses_where_it_does_not_apply(
        tiny_hf, tiny_engine, caplog, monkeypatch):
    from servelm import engine_builder

    monkeypatch.setattr(engine_builder, "available_memory_bytes", lambda device: 1 << 10)
    _, engine, log = _engine(tiny_hf, tiny_engine, caplog, "auto")
    assert log.endswith("gemm=onednn")
    with pytest.raises(ValueError, match=r"gemm=kernel: .*quarter of the free memory"):
        tiny_engine(tiny_hf("llama"), cpu_kernels="gemm=kernel")
    monkeypatch.setattr("servelm.layers.linear.panel_rows", lambda: 0)
    monkeypatch.setattr(engine_builder, "available_memory_bytes", lambda device: 1 << 40)
    with pytest.raises(ValueError, match=r"gemm=kernel: .*no AVX2"):
        tiny_engine(tiny_hf("llama"), cpu_kernels="gemm=kernel")
