"""Batch-invariant decode attention (split_len > 0): a sequence's output is the same bits
whatever the longest sequence beside it (and so the number of splits launched), and it is
attention (the torch reference)."""

import pytest
import torch

from servelm.kernels.decode_attention import (decode_attention, decode_attention_ref,
                                              fixed_num_splits)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 32)])
def test_a_row_is_the_same_bits_beside_any_batch(heads, kv_heads, head_dim, paged_kv):
    gen = torch.Generator().manual_seed(heads)
    lens = [300, 70, 5]
    k_cache, v_cache, tables = paged_kv(3, lens, 8, kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(3, heads, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    split, block_n = 32, 16

    def attend(rows):
        n = fixed_num_splits(max(lens[r] for r in rows), split)
        return decode_attention(q[rows], k_cache, v_cache, tables[rows], seq_lens[rows], 8,
                                head_dim ** -0.5, n, block_n=block_n, split_len=split)

    together = attend([0, 1, 2])  # 10 splits
    assert torch.equal(attend([1]), together[1:2])  # 3 splits
    assert torch.equal(attend([2, 1]), together[[2, 1]])
    ref = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 8, head_dim ** -0.5)
    torch.testing.assert_close(together, ref, atol=2e-5, rtol=1e-5)


def test_splits_that_do_not_cover_a_sequence_are_refused(paged_kv):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv(1, [100], 8, 1, 16, torch.float32, gen)
    q = torch.randn(1, 2, 16, generator=gen).to(DEVICE)
    lens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="do not cover"):
        decode_attention(q, k_cache, v_cache, tables, lens, 8, 0.25, 2, block_n=16,
                         split_len=32)
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_attention(q, k_cache, v_cache, tables, lens, 8, 0.25, 4, block_n=16,
                         split_len=40)
