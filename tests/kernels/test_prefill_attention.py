"""Prefill/extend attention over paged K/V matches the torch reference.

Sequences mix fresh prompts (no prefix), chunks after a cached prefix that ends mid-block,
single-token queries, and query spans longer than one query tile; GQA ratios 1, 2, 4, 8.
"""

import pytest
import torch

from servelm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from servelm.kernels.fp8_format import FP8_DTYPE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (num_heads, num_kv_heads, head_dim, block_size, block_m, block_n)
CASES = [
    (4, 4, 16, 4, 16, 16),    # MHA
    (4, 2, 16, 16, 16, 32),   # GQA 2
    (8, 2, 24, 8, 32, 16),    # GQA 4, head_dim not a power of two
    (16, 2, 16, 32, 16, 16),  # GQA 8, block larger than the key tile
]


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}K{}D{}bs{}m{}n{}".format(*c))
def test_prefill_matches_reference(case, dtype, paged_kv):
    _check(case, dtype, paged_kv, seed=sum(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(dtype, paged_kv):
    _check((8, 2, 32, 16, 16, 16), dtype, paged_kv, seed=11)


def _check(case, dtype, paged_kv, seed):
    num_heads, num_kv_heads, head_dim, block_size, block_m, block_n = case
    gen = torch.Generator().manual_seed(seed)
    # (cached prefix, new tokens): fresh, prefix ending mid-block, one token, > one query tile
    spans = [(0, 7), (block_size + 3, 5), (9, 1), (int(torch.randint(0, 20, (1,),
                                                                      generator=gen)), 40)]
    q_lens = [n for _, n in spans]
    seq_lens = [c + n for c, n in spans]
    k_cache, v_cache, tables = paged_kv(len(spans), seq_lens, block_size, num_kv_heads,
                                        head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ours = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), block_size,
                             scale, block_m=block_m, block_n=block_n)
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, qsl, lens, block_size, scale)
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_reference_matches_sdpa_on_a_fresh_prompt(paged_kv):
    """The reference itself: with no prefix it is plain causal attention."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = paged_kv(1, [9], 4, 2, 16, torch.float32, gen)
    q = torch.randn(9, 4, 16, generator=gen).to(DEVICE)
    pos = torch.arange(9, device=DEVICE)
    slots = tables[0, pos // 4].long() * 4 + pos % 4
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1),
        is_causal=True, enable_gqa=True).transpose(0, 1)
    qsl = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, qsl,
                                torch.tensor([9], device=DEVICE), 4, 0.25)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_prefill_random_shapes(seed, paged_kv):
    """Shapes drawn at random (seeded): GQA ratio, head dim, block size (1 to 32), tiles, dtype."""
    rng = torch.Generator().manual_seed(2000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_kv_heads, group = pick([1, 2, 4]), pick([1, 2, 4, 8])
    case = (num_kv_heads * group, num_kv_heads, pick([16, 24, 32, 64]), pick([1, 2, 4, 16, 32]),
            pick([16, 32]), pick([16, 32]))
    _check(case, pick([torch.float32, torch.float32, torch.float16, torch.bfloat16]), paged_kv,
           seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(8, 2, 24, 8, 32, 16), (4, 4, 16, 4, 16, 16)],
                         ids=lambda c: "H{}K{}D{}bs{}m{}n{}".format(*c))
def test_prefill_fp8_cache_matches_dequantized_reference(case, dtype, paged_kv):
    """An fp8 cache (e4m3 codes, a scale per KV head) read by the kernel gives what the
    reference computes on the dequantized cache (codes * scale)."""
    num_heads, num_kv_heads, head_dim, block_size, block_m, block_n = case
    gen = torch.Generator().manual_seed(sum(case) + 1)
    spans = [(0, 7), (block_size + 3, 5), (9, 1), (5, 40)]
    q_lens = [n for _, n in spans]
    seq_lens = [c + n for c, n in spans]
    k_cache, v_cache, tables = paged_kv(len(spans), seq_lens, block_size, num_kv_heads,
                                        head_dim, FP8_DTYPE, gen)
    k_scale = (torch.rand(num_kv_heads, generator=gen) + 0.25).to(DEVICE)
    v_scale = (torch.rand(num_kv_heads, generator=gen) + 0.25).to(DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ours = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), block_size,
                             scale, block_m=block_m, block_n=block_n, k_scale=k_scale,
                             v_scale=v_scale)
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, qsl, lens, block_size, scale,
                                k_scale, v_scale)
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    plain = prefill_attention_ref(q, k_cache.float(), v_cache.float(), tables, qsl, lens,
                                  block_size, scale)
    assert (plain.float() - ref.float()).abs().max() > 10 * ATOL[dtype]
