"""Kernel tests run on a GPU when there is one, else under the Triton interpreter on the CPU.

TRITON_INTERPRET must be set before triton is first imported (kernels decide at decoration
time whether they are interpreted), so it is set here, before any test module imports
servelm.kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_paged_kv(num_seqs, seq_lens, block_size, num_kv_heads, head_dim, dtype, gen,
                    spare_blocks=3):
    """Caches full of random values and, per sequence, a table of distinct shuffled blocks
    covering its length (padded with 0, as ForwardBatch pads). Block order is scrambled so a
    kernel that ignores the table cannot pass."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(blocks_per_seq))
    tables = torch.zeros((num_seqs, width), dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return k_cache, v_cache, tables.to(DEVICE)


@pytest.fixture
def paged_kv():
    return random_paged_kv

