"""Split-K decode attention over paged K/V matches the torch reference.

Random shapes per case: ragged context lengths (1 token, mid-block ends, several key tiles),
block sizes smaller and larger than the key tile, GQA ratios 1 (MHA), 2, 4, 8 and MQA, and
more splits than a short sequence can fill (empty splits must weigh nothing).
"""

import pytest
import torch

from servelm.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from servelm.kernels.fp8_format import FP8_DTYPE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (num_heads, num_kv_heads, head_dim, block_size, block_n, num_splits)
CASES = [
    (4, 4, 16, 4, 16, 1),     # MHA, one split
    (4, 2, 16, 16, 16, 3),    # GQA 2
    (8, 2, 32, 8, 32, 4),     # GQA 4, block smaller than the key tile
    (16, 2, 16, 32, 16, 2),   # GQA 8, block larger than the key tile
    (8, 1, 24, 4, 16, 8),     # MQA, head_dim not a power of two, many empty splits
]


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}K{}D{}bs{}n{}s{}".format(*c))
def test_decode_matches_reference(case, dtype, paged_kv):
    _check(case, dtype, paged_kv, seed=sum(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype, paged_kv):
    _check((8, 2, 32, 16, 16, 3), dtype, paged_kv, seed=7)


def _check(case, dtype, paged_kv, seed):
    num_heads, num_kv_heads, head_dim, block_size, block_n, num_splits = case
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, block_size + 1, 3 * block_n - 1] + torch.randint(
        2, 70, (2,), generator=gen).tolist()
    k_cache, v_cache, tables = paged_kv(len(seq_lens), seq_lens, block_size, num_kv_heads,
                                        head_dim, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ours = decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale, num_splits,
                            block_n=block_n)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, block_size, scale)
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_zero_length_sequence_gives_zeros(paged_kv):
    """A CUDA graph's padding rows have seq_len 0: finite zeros, not NaN."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = paged_kv(2, [5, 1], 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    lens = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 4, 0.25, num_splits=2, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, 4, 0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 100) == 1  # short context: one split
    assert choose_num_splits(1, 8, 8192) == 32  # batch 1, long context: the GPU needs splits
    assert choose_num_splits(1, 8, 2000) == 8  # but none shorter than 256 keys
    assert choose_num_splits(256, 8, 8192) == 1  # a big batch already fills the GPU


@pytest.mark.parametrize("seed", range(6))
def test_decode_random_shapes(seed, paged_kv):
    """Shapes drawn at random (seeded): GQA ratio, head dim, block size (1 to 32), key tile,
    split count, batch and dtype."""
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_kv_heads, group = pick([1, 2, 4]), pick([1, 2, 4, 8])
    case = (num_kv_heads * group, num_kv_heads, pick([16, 24, 32, 64]), pick([1, 2, 4, 16, 32]),
            pick([16, 32]), pick([1, 2, 5, 8]))
    _check(case, pick([torch.float32, torch.float32, torch.float16, torch.bfloat16]), paged_kv,
           seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(8, 2, 32, 16, 16, 3), (8, 1, 24, 4, 16, 8)],
                         ids=lambda c: "H{}K{}D{}bs{}n{}s{}".format(*c))
def test_decode_fp8_cache_matches_dequantized_reference(case, dtype, paged_kv):
    """An fp8 cache (e4m3 codes, a scale per KV head) read by the kernel gives what the
    reference computes on the dequantized cache (codes * scale)."""
    num_heads, num_kv_heads, head_dim, block_size, block_n, num_splits = case
    gen = torch.Generator().manual_seed(sum(case))
    seq_lens = [1, block_size + 1, 3 * block_n - 1, 37]
    k_cache, v_cache, tables = paged_kv(len(seq_lens), seq_lens, block_size, num_kv_heads,
                                        head_dim, FP8_DTYPE, gen)
    k_scale = (torch.rand(num_kv_heads, generator=gen) + 0.25).to(DEVICE)
    v_scale = (torch.rand(num_kv_heads, generator=gen) + 0.25).to(DEVICE)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ours = decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale, num_splits,
                            block_n=block_n, k_scale=k_scale, v_scale=v_scale)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, block_size, scale,
                               k_scale, v_scale)
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    # the scales are applied: without them the reference differs
    plain = decode_attention_ref(q, k_cache.float(), v_cache.float(), tables, lens, block_size,
                                 scale)
    assert (plain.float() - ref.float()).abs().max() > 10 * ATOL[dtype]
