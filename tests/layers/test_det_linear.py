"""DetLinear (deterministic mode's float32 linear, cpu_kernels/det_gemm.cpp): a row's output
is the same bits at any batch size, at any place in the batch and at any thread count, and it
is a correct matmul; make_deterministic swaps every float linear (bfloat16 ones for servelm's
bfloat16 GEMM) and refuses the rest."""

import pytest
import torch
from torch import nn

from servelm.layers.det_linear import (DetLinear, cpu_linear_kind, det_linear_calls,
                                       make_deterministic)
from servelm.layers.linear import PackedLinear, can_pack


@pytest.mark.parametrize("n,k", [(100, 37), (64, 200), (130, 576)])
def test_a_row_is_the_same_bits_at_every_batch_size_and_position(n, k):
    torch.manual_seed(0)
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    lin = DetLinear(w, b)
    x = torch.randn(230, k)  # past one chunk of rows (192)
    full = lin(x)
    calls = det_linear_calls()
    for m in (1, 2, 5, 6, 7, 23, 24, 25, 64, 191, 192, 193):
        for start in (0, 3, 230 - m):
            part = lin(x[start:start + m])
            assert torch.equal(part, full[start:start + m]), (m, start)
    assert det_linear_calls() > calls
    ref = (x.double() @ w.double().t() + b.double()).float()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)


def test_the_thread_count_does_not_move_a_bit():
    torch.manual_seed(1)
    lin = DetLinear(torch.randn(300, 576), None)
    x = torch.randn(70, 576)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(max(2, saved))
        many = lin(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, many)


def test_leading_dimensions_are_kept():
    lin = DetLinear(torch.randn(20, 16), None)
    x = torch.randn(3, 5, 16)
    assert torch.equal(lin(x), lin(x.reshape(15, 16)).reshape(3, 5, 20))


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN")
def test_packed_weights_come_back_exactly():
    w = torch.randn(96, 48)
    assert torch.equal(PackedLinear(w, None).dense_weight(), w)


class _Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.packed = PackedLinear(torch.randn(8, 32), torch.randn(8))
        self.lm_head = None if tied else nn.Linear(16, 50, bias=False)


def test_make_deterministic_swaps_every_float_linear_and_a_tied_head():
    model = _Tiny(tied=True)
    x = torch.randn(4, 16)
    want = model.packed(model.proj(x))
    assert make_deterministic(model) == 3
    assert all(type(m) is not nn.Linear and type(m) is not PackedLinear
               for m in model.modules())
    torch.testing.assert_close(model.packed(model.proj(x)), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.lm_head(x), x @ model.embed_tokens.weight.t(),
                               rtol=1e-5, atol=1e-5)


def test_make_deterministic_refuses_what_it_cannot_make_invariant():
    from servelm.quant.int8_linear import Int8Linear

    model = _Tiny(tied=False)
    model.proj = Int8Linear.from_float(torch.randn(32, 16))
    with pytest.raises(ValueError, match="quantized"):
        make_deterministic(model)
    half = nn.Sequential(nn.Linear(16, 16).to(torch.float16))
    with pytest.raises(ValueError, match="float32, or bfloat16.*float16"):
        make_deterministic(half)


@pytest.mark.skipif(cpu_linear_kind(torch.bfloat16) is None,
                    reason="no bfloat16 GEMM of servelm's runs on this CPU")
def test_make_deterministic_takes_bf16_linears_to_servelms_bf16_gemm():
    """Every row count on one kernel (never oneDNN); the tied head's logits float32 sums."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.dot_linear import DotLinear

    model = _Tiny(tied=True)
    model.packed = PackedLinear(torch.randn(8, 32).bfloat16(), None)  # oneDNN's bfloat16 form
    model.to(torch.bfloat16)
    x = torch.randn(4, 16).bfloat16()
    want = model.packed(model.proj(x)).float()
    assert make_deterministic(model) == 3
    kind = {"dot": DotLinear, "amx": AmxLinear}[cpu_linear_kind(torch.bfloat16)]
    assert type(model.proj) is kind and type(model.packed) is kind
    torch.testing.assert_close(model.packed(model.proj(x)).float(), want, rtol=0.02, atol=0.02)
    assert type(model.lm_head) is DotLinear
    logits = model.lm_head(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ model.embed_tokens.weight.float().t(),
                               rtol=1e-5, atol=1e-5)
