"""A bfloat16 head's logits near each row's maximum are recomputed in float32
(servelm/runner/logits.py): ties that bfloat16 rounding makes are decided by value, the
argmax is the float32 argmax of the same hidden state, and other logits are left alone."""

from __future__ import annotations

import torch
from torch import nn

from servelm.layers.linear import PackedLinear, can_pack
from servelm.runner.logits import head_rows, refine_near_max


def _case(seed: int, rows: int = 8, vocab: int = 3000, hidden: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g).bfloat16()
    h = torch.randn(rows, hidden, generator=g).bfloat16() * 4
    return w, h


def test_refined_argmax_is_the_float32_argmax_where_bfloat16_ties():
    flipped = ties = 0
    for seed in range(40):
        w, h = _case(seed)
        exact = h.float() @ w.float().t()
        rounded = (h @ w.t()).float()  # the 16-bit head, as the model computes it
        logits = rounded.clone()
        n = refine_near_max(logits, h, w)
        top = rounded.max(-1, keepdim=True).values
        ties += int(((rounded == top).sum(-1) > 1).sum())
        flipped += int((rounded.argmax(-1) != exact.argmax(-1)).sum())
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))
        changed = logits != rounded
        assert int(changed.sum()) <= n  # only the recomputed ones moved ...
        assert torch.allclose(logits[changed], exact[changed], atol=1e-4, rtol=1e-5)  # to exact
        assert (rounded[changed] >= top.expand_as(rounded)[changed] - top.abs().max() / 64).all()
    assert ties > 0 and flipped > 0  # the case this exists for happened, and was fixed


def test_a_clear_maximum_is_left_alone_and_softcap_applies():
    w, h = _case(1, rows=1)
    logits = (h @ w.t()).float()
    top = int(logits.argmax())
    logits[0, top] += 10.0  # far above the rest: nothing to decide
    before = logits.clone()
    assert refine_near_max(logits, h, w) == 0 and torch.equal(logits, before)
    logits = torch.zeros(1, 4)
    logits[0, 1] = logits[0, 2] = 20.0
    hw = torch.zeros(4, 2, dtype=torch.bfloat16)
    hw[1, 0], hw[2, 0] = 2.0, 3.0
    hidden = torch.tensor([[10.0, 0.0]], dtype=torch.bfloat16)
    assert refine_near_max(logits, hidden, hw, softcap=30.0) == 2
    assert torch.allclose(logits[0, 1:3], torch.tanh(torch.tensor([20.0, 30.0]) / 30) * 30)


def test_head_rows_finds_a_tied_or_plain_16_bit_head_only():
    class Tiny(nn.Module):
        def __init__(self, tied, dtype, packed=False):
            super().__init__()
            self.config = type("C", (), {"tie_word_embeddings": tied})()
            self.embed_tokens = nn.Embedding(10, 4).to(dtype)
            head = nn.Linear(4, 10, bias=False).to(dtype)
            self.lm_head = None if tied and not packed else head
            if packed:
                self.lm_head = PackedLinear(self.embed_tokens.weight if tied else head.weight,
                                            None)

    assert head_rows(Tiny(True, torch.bfloat16)) is not None
    plain = Tiny(False, torch.bfloat16)
    assert head_rows(plain) is plain.lm_head.weight
    assert head_rows(Tiny(True, torch.float32)) is None  # nothing to refine
    # oneDNN packs a bfloat16 weight only on a CPU with a bfloat16 GEMM (else the head stays
    # an nn.Linear, the case above); a float32 packed head has nothing to refine either
    tied_packed = Tiny(True, torch.float32, packed=True)
    assert head_rows(tied_packed) is None
    if can_pack(torch.device("cpu"), torch.bfloat16):
        tied_packed = Tiny(True, torch.bfloat16, packed=True)
        assert head_rows(tied_packed) is tied_packed.embed_tokens.weight
        assert head_rows(Tiny(False, torch.bfloat16, packed=True)) is None  # no rows kept


def test_finish_logits_equals_the_refinement_of_every_tied_row():
    """The runner's one-pass path (C++ on the CPU) gives the refined float32 argmax and
    recomputes exactly the tied rows; the rows with a clear maximum keep their bf16 values."""
    from servelm.runner.logits import finish_logits

    ties = 0
    for seed in range(20):
        w, h = _case(seed, rows=16)
        raw = h @ w.t()
        exact = h.float() @ w.float().t()
        logits, argmax = finish_logits(raw, h, w)
        assert argmax is not None  # the C++ pass ran
        assert torch.equal(argmax, exact.argmax(-1)) and torch.equal(argmax, logits.argmax(-1))
        rounded = raw.float()
        top = rounded.max(-1, keepdim=True).values
        step = torch.exp2(torch.floor(torch.log2(top.abs())) - 7)
        tied = (rounded >= top - step).sum(-1) > 1
        ties += int(tied.sum())
        assert torch.equal(logits[~tied], rounded[~tied])
        if tied.any():
            expect = rounded[tied].clone()
            refine_near_max(expect, h[tied], w)
            assert torch.equal(logits[tied], expect)
    assert ties > 0
    # float32 logits: no refinement, no copy, the argmax all the same
    f = torch.randn(3, 50)
    logits, argmax = finish_logits(f, torch.zeros(3, 4), None)
    assert logits is f and torch.equal(argmax, f.argmax(-1))


def test_the_sampler_uses_a_given_argmax_only_on_unchanged_logits():
    from servelm.sampling.sampler import SamplingTensors, sample

    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    wrong = torch.tensor([2, 2])  # a stand-in that differs from the true argmax
    greedy = torch.zeros(2)
    assert sample(logits, SamplingTensors(greedy), wrong).token_ids.tolist() == [2, 2]
    biased = SamplingTensors(greedy, biases=[(0, [0], [10.0]), (1, [0], [10.0])])
    assert sample(logits, biased, wrong).token_ids.tolist() == [0, 0]  # recomputed
    assert sample(logits, SamplingTensors(greedy)).token_ids.tolist() == [1, 0]
