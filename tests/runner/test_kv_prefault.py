"""The KV pool's lowest blocks are mapped at start-up (KVCache.prefault); the rest stay
unmapped until first written, and the pool reads as zeros either way. An engine maps what
its sequences could use, at most PREFAULT_BYTES."""

import ctypes
import mmap

import pytest
import torch

from servelm.attention import kv_cache
from servelm.attention.kv_cache import KVCache
from servelm.config import ModelConfig

# 4 layers, 2 KV heads of 64: a 16-slot block is 4 * 2 * 16 * 2 * 64 * 2 = 32 KiB (bf16)
CONFIG = ModelConfig("llama", 64, 128, 256, 4, 4, 2, 16, 256)
PAGE = mmap.PAGESIZE


def _resident(t: torch.Tensor) -> list[bool]:
    """mincore(2) of the pages t spans: whether each is mapped in memory now."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // PAGE * PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return [bool(b & 1) for b in vec]


def _interior(pool: torch.Tensor, layer: int, first: int, last: int) -> torch.Tensor:
    """Slots of blocks first..last-1 of one layer, trimmed to whole pages inside them."""
    t = pool[layer, first * 16:last * 16].reshape(-1).view(torch.uint8)
    lead = (-t.data_ptr()) % PAGE
    n = (t.numel() - lead) // PAGE * PAGE
    return t[lead:lead + n]


@pytest.mark.parametrize("populate", ["madvise", "write"])
def test_lowest_blocks_mapped_rest_lazy(monkeypatch, populate):
    if populate == "write":  # a kernel without MADV_POPULATE_WRITE: one write a page
        monkeypatch.setattr(kv_cache, "_libc", lambda: None)
    per_block = KVCache.bytes_per_block(CONFIG, 16, torch.bfloat16)
    cache = KVCache(CONFIG, 400, 16, torch.bfloat16, torch.device("cpu"))
    assert not any(_resident(_interior(cache.k, 0, 0, 400)))  # mapped lazily ...
    assert cache.prefault(40 * per_block + per_block // 2) == 40  # ... until asked
    for pool in (cache.k, cache.v):
        for layer in range(CONFIG.num_layers):
            assert all(_resident(_interior(pool, layer, 0, 40)))
            assert not any(_resident(_interior(pool, layer, 41, 400)))
    assert cache.prefault(0) == 0
    assert cache.prefault(10 ** 12) == 400  # a budget past the pool maps all of it
    assert all(_resident(_interior(cache.k, 3, 0, 400)))
    assert not cache.k.any() and not cache.v.any()


def test_engine_maps_what_its_sequences_could_use():
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    hf = make_tiny_hf_model()
    engine = make_tiny_engine(hf, max_num_seqs=2, num_blocks=4096, block_size=16)
    cache = engine.runner.kv_cache
    per_token = KVCache.bytes_per_block(engine.runner.model.config, 16, cache.k.dtype) // 16
    max_len = hf.config.max_position_embeddings
    blocks = 2 * max_len * per_token // (16 * per_token)  # 2 sequences of max_len tokens
    assert 0 < blocks < cache.num_blocks - 1
    for layer in range(cache.k.shape[0]):
        assert all(_resident(_interior(cache.k, layer, 0, blocks)))
        assert not any(_resident(_interior(cache.v, layer, blocks + 1, cache.num_blocks)))
