"""Bfloat16 linears in two forms (layers/linear.py, pair_with_tiles): steps of up to AMX_ROWS
rows on servelm's AMX tile GEMM (AmxLinear), steps of more on oneDNN's packed GEMM. Both
compute the layer's matmul; the engine pairs a bfloat16 model's linears where AMX-BF16 runs
(`--cpu-kernels gemm`), the decode stack takes the tile form, and the option turns it off or
insists on it."""

import pytest
import torch

from servelm.layers.amx_linear import AmxLinear, amx_usable
from servelm.layers.linear import AMX_ROWS, PackedLinear, can_pack, pair_with_tiles
from servelm.quant.mixed_linear import MixedLinear
from bf16_linears import TiedTiny, bf16_engine
from tiny_models import greedy, prefill_logits

needs_amx = pytest.mark.skipif(
    not amx_usable() or not can_pack(torch.device("cpu"), torch.bfloat16),
    reason="AMX-BF16 does not run here, or oneDNN has no bfloat16 GEMM")


@needs_amx
def test_every_bf16_linear_and_a_tied_head_get_both_forms():
    torch.manual_seed(0)
    model = TiedTiny()
    assert pair_with_tiles(model, max_rows=8) == 2
    for layer in (model.proj, model.lm_head):
        assert type(layer) is MixedLinear and layer.max_rows == 8
        assert type(layer.full) is PackedLinear and type(layer.small) is AmxLinear
    w = model.proj.small.dense_weight()
    for rows in (3, 40):  # the tiles, then oneDNN
        x = torch.randn(rows, 32).bfloat16()
        want = x.float() @ w.float().t() + model.proj.full.bias.float()
        torch.testing.assert_close(model.proj(x).float(), want, rtol=2 ** -7, atol=1e-2)


@needs_amx
def test_a_bf16_engine_decodes_on_the_tiles(tiny_hf, tiny_engine, caplog):
    hf, paired, log = bf16_engine(tiny_hf, tiny_engine, caplog, "auto")
    assert log.endswith(f"gemm=amx<={AMX_ROWS}+onednn")
    mixed = [m for m in paired.runner.model.modules() if type(m) is MixedLinear]
    assert len(mixed) == 2 * 4 + 1 and all(type(m.small) is AmxLinear for m in mixed)
    _, plain, log = bf16_engine(tiny_hf, tiny_engine, caplog, "gemm=torch")
    assert log.endswith("gemm=onednn")
    assert not any(type(m) is MixedLinear for m in plain.runner.model.modules())
    prompt = [int(t) for t in torch.randint(0, 384, (100,), generator=torch.Generator()
                                            .manual_seed(3))]
    greedy(paired, prompt[:20], 6)
    assert "small" in paired.runner.cpu_stack._stacks  # decode steps: the stack's tile form
    with torch.no_grad():
        want = hf.to(torch.float32)(torch.tensor([prompt])).logits[0]
    for n in (100, 10):  # 100 rows: oneDNN; 10: the tiles
        got = prefill_logits(paired, prompt[:n])
        torch.testing.assert_close(got, want[:n], rtol=0.05, atol=0.05)
        torch.testing.assert_close(got, prefill_logits(plain, prompt[:n]), rtol=0.02, atol=0.02)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bfloat16 GEMM here: nothing is packed or paired")
def test_the_tile_pairing_steps_aside_or_refuses_where_it_does_not_apply(
        tiny_hf, tiny_engine, caplog, monkeypatch):
    from servelm import engine_builder
    from servelm.layers import amx_linear, dot_linear

    monkeypatch.setattr(amx_linear, "amx_usable", lambda: False)
    monkeypatch.setattr(dot_linear, "dot_usable", lambda: False)
    _, engine, log = bf16_engine(tiny_hf, tiny_engine, caplog, "auto")
    assert log.endswith("gemm=onednn")
    with pytest.raises(ValueError, match=r"gemm=kernel: .*AMX-BF16 does not run here"):
        tiny_engine(tiny_hf("llama"), dtype="bfloat16", cpu_kernels="gemm=kernel")
    monkeypatch.setattr(amx_linear, "amx_usable", lambda: True)
    monkeypatch.setattr(engine_builder, "available_memory_bytes", lambda device: 1 << 10)
    with pytest.raises(ValueError, match=r"gemm=kernel: .*quarter of the free memory"):
        tiny_engine(tiny_hf("llama"), dtype="bfloat16", cpu_kernels="gemm=kernel")
