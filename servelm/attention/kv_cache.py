"""KV cache tensors: one K and one V pool per layer, indexed by slot.

    k[layer]: [num_blocks * block_size, K, D]    slot = block * block_size + offset

MLA (DeepSeek-V2/V3, ModelConfig.is_mla): a token's entry is its compressed latent and its
rotated rope key, shared by every head; that is all the cache holds:

    k[layer]: [num_slots, 1, kv_lora_rank + qk_rope_head_dim]   = [latent | rope key]
    v[layer]: [num_slots, 1, 0]                                  (empty)

fp8 (`--kv-cache-dtype fp8`): k and v hold float8_e4m3fn codes, one byte per element, and
each layer has a scale per KV head for K and one for V:

    K[slot, h, :] ~= k[layer][slot, h, :] * k_scale[layer, h]      (likewise V, v_scale)

The scales are static, 1.0 unless set (`set_scales`), as vLLM's default for checkpoints that
carry none: e4m3's relative precision (2^-4) is the same everywhere in its normal range
[2^-6, 448], so a scale only matters for values that would leave that range, and K/V of the
models served here stay well inside it (docs/quantization.md). A static scale also keeps a
request's output independent of which requests came before it, which a scale calibrated on
the first traffic would not.

Owns the pool tensors, the scales, and how a token's K/V is written (`store`). Never:
decides which slots a sequence gets, or computes attention. The engine builder sizes and
builds it, the runner holds it; it lives here, beside the backends that read it, so that
attention/ never imports runner/.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap

import torch

from servelm.config import ModelConfig
from servelm.kernels.fp8_format import FP8_DTYPE, quantize_fp8


def _store_ops(cache: torch.Tensor):
    """torch.ops.servelm_cpu where K/V rows may be written by its store_kv (a CPU cache,
    kernels built and chosen for attention), else None."""
    if cache.device.type != "cpu":
        return None
    from servelm import cpu_kernels

    return cpu_kernels.ops_for_mode("attention")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV blocks are stored in: the model's ('auto') or float8_e4m3fn ('fp8')."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero pool. On the CPU, an anonymous memory map: the kernel hands out zero pages as
    they are first touched, where torch.zeros would write every byte of gigabytes at start-up
    (about 0.4 s a GB on the CI machine) for blocks that may never be used.

    Private, not shared (Python's default for an anonymous map): a shared page costs more
    to fault in, and a 2048-token prefill step stores 1.5 MB of K/V a layer into fresh
    blocks (docs/benchmarks.md, step-profile record). Transparent huge pages (madvise) were
    tried twice and dropped: faulted lazily they made those stores about 4x slower (on the CI
    machine's VM the host backs fresh guest memory on first touch, which a 2 MiB page meets
    more often: 2.2 s for the first 512 MiB of them, 0.02 s once backed), and on the part
    mapped at start-up they ran the default batch no faster than 4 KiB pages.
    The pool is never shared with a forked process. The blocks handed out first are mapped
    at start-up (KVCache.prefault)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the map alive (frombuffer's reference)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


# Bytes of a CPU pool (K and V, all layers) the engine maps at start-up (KVCache.prefault,
# engine_builder.py): the lowest block ids, which the BlockManager hands out first. A first
# store into a page of the lazily mapped pool costs a page fault: a batch of 64 fresh prompts
# of 32-256 tokens with 128 new tokens each, on the default model, took 100,000 of them (405
# MB of pool) and 0.17 s of system time in its 7 s (docs/benchmarks.md). Mapping 512 MiB at
# start-up takes about 0.16 s on the same machine (the whole default pool, 2 GiB, 0.6 s);
# the rest of the pool maps lazily.
PREFAULT_BYTES = 512 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels: EINVAL, and a write a page instead


def _prefault(t: torch.Tensor) -> None:
    """Map t's pages now (t: a contiguous slice of a CPU pool from _zeros, all zeros)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page  # the slice's first page (shared with what precedes)
    libc = _libc()
    if libc is not None and libc.madvise(ctypes.c_void_p(start),
                                         ctypes.c_size_t(t.data_ptr() + nbytes - start),
                                         _MADV_POPULATE_WRITE) == 0:
        return
    flat = t.view(-1).view(torch.uint8)  # a zero written where a zero is: one byte a page
    flat[::page].zero_()
    flat[-1:].zero_()  # the last page, where the slice starts inside its first


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        """dtype: the storage dtype (the model's, or float8_e4m3fn for an fp8 cache)."""
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.is_mla = config.is_mla
        if self.is_mla:
            if dtype == FP8_DTYPE:
                raise ValueError("kv_cache_dtype 'fp8' is not supported for MLA models")
            entry = config.kv_lora_rank + config.qk_rope_head_dim
            self.k = _zeros(shape[:2] + (1, entry), dtype, device)
            self.v = _zeros(shape[:2] + (1, 0), dtype, device)
        else:
            self.k = _zeros(shape, dtype, device)
            self.v = _zeros(shape, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_fp8 = dtype == FP8_DTYPE
        self.k_scale = self.v_scale = None  # [num_layers, K] float32 when fp8
        if self.is_fp8:
            scale_shape = (config.num_layers, config.num_kv_heads)
            self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)

    def prefault(self, budget: int) -> int:
        """Map a CPU pool's pages for the lowest block ids now, up to `budget` bytes in all
        (K and V, every layer), so that the first requests' K/V stores do not fault them in
        one by one. Returns the number of blocks mapped (0 off the CPU: nothing to do)."""
        if self.k.device.type != "cpu":
            return 0
        per_block = self.block_nbytes
        blocks = min(self.num_blocks, budget // per_block) if per_block else 0
        for pool in (self.k, self.v):
            for layer in pool:
                _prefault(layer[:blocks * self.block_size])
        return blocks

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale[K], v_scale[K]) of layer i for an fp8 cache; (None, None) otherwise."""
        if not self.is_fp8:
            return None, None
        return self.k_scale[i], self.v_scale[i]

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Replace the fp8 scales ([num_layers, K], or anything that broadcasts to it), in
        place so a captured CUDA graph sees them. Only before any K/V is written: codes
        already stored were quantized with the old scales."""
        if not self.is_fp8:
            raise ValueError("kv_cache_dtype is not 'fp8': this cache has no scales to set")
        for name, new, old in (("k_scale", k_scale, self.k_scale),
                               ("v_scale", v_scale, self.v_scale)):
            new = torch.as_tensor(new, dtype=torch.float32, device=old.device)
            if not bool(torch.isfinite(new).all()) or not bool((new > 0).all()):
                raise ValueError(f"{name} must be finite and positive")
            old.copy_(new.expand_as(old))

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, K, D] into `slots` [T] of `layer`; return them as the cache now
        holds them (fp8 codes for an fp8 cache, else k and v in the cache's dtype), so a
        prefill that attends its own fresh tokens sees what a later step will read back."""
        k_cache, v_cache = self.layer(layer)
        if not self.is_fp8:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            ops = (_store_ops(k_cache) if k_cache.shape == v_cache.shape
                   and k.stride(2) == 1 and v.stride(2) == 1 else None)
            if ops is not None:  # both in one C++ call (cpu_kernels/paged_attention.cpp)
                ops.store_kv(k_cache, v_cache, slots, k, v)
            else:
                k_cache.index_copy_(0, slots, k)
                v_cache.index_copy_(0, slots, v)
            return k, v
        k_scale, v_scale = self.layer_scales(layer)
        kq = quantize_fp8(k, k_scale[:, None])
        vq = quantize_fp8(v, v_scale[:, None])
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
        k_cache.view(torch.uint8).index_copy_(0, slots, kq.view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(0, slots, vq.view(torch.uint8))
        return kq, vq

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block as read_block returns it (every layer, K and V)."""
        per_slot = (self.k[0, 0].numel() * self.k.element_size()
                    + self.v[0, 0].numel() * self.v.element_size())
        return per_slot * self.block_size * self.k.shape[0]

    def _block_views(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one block as bytes: [L, block_size * K * D * element size] each."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id {block_id} is outside the pool (0..{self.num_blocks - 1})")
        lo = block_id * self.block_size
        hi = lo + self.block_size
        num_layers = self.k.shape[0]
        k = self.k[:, lo:hi].contiguous().view(torch.uint8).reshape(num_layers, -1)
        v = self.v[:, lo:hi].contiguous().view(torch.uint8).reshape(num_layers, -1)
        return k, v

    def read_block(self, block_id: int) -> bytes:
        """One block's contents, the layout write_block takes back:

            layer 0: K[block_size, K, D] V[block_size, K, D] | layer 1: K V | ...

        in the storage dtype (fp8 codes for an fp8 cache: its scales are fixed per config,
        so the codes mean the same in any pool of the same configuration)."""
        k, v = self._block_views(block_id)
        return torch.cat([k, v], dim=1).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        """Overwrite one block with bytes read_block gave (here or in a pool of the same
        model, dtype and block size)."""
        if len(data) != self.block_nbytes:
            raise ValueError(f"KV block data is {len(data)} bytes, this pool's blocks are "
                             f"{self.block_nbytes}")
        num_layers = self.k.shape[0]
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(num_layers, -1)
        k_bytes = src.shape[1] - self.v[0, :self.block_size].numel() * self.v.element_size()
        lo = block_id * self.block_size
        hi = lo + self.block_size
        self._block_views(block_id)  # range check
        for pool, part in ((self.k, src[:, :k_bytes]), (self.v, src[:, k_bytes:])):
            if part.numel():
                dst = pool[:, lo:hi]
                dst.copy_(part.contiguous().view(pool.dtype).view(dst.shape).to(pool.device))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V (the fp8 scales, 8 bytes per layer
        and KV head for the whole pool, are not counted)."""
        return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
