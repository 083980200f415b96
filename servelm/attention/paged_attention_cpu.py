"""Which path CPU decodes take: the C++ paged kernel (servelm/cpu_kernels/paged_attention.cpp)
or the torch backend's gather + SDPA. Chosen once, when a backend is built, by the engine
option `--cpu-kernels attention=MODE` (servelm/config/cpu_kernel_choice.py):

    auto    the kernel for fp32/bf16/fp8 caches on the CPU where it builds, else the torch
            path (default)
    kernel  the same, but a failed build is an error
    torch   always the torch path

paged_decode(q [B, H, D], k_cache, v_cache [num_slots, K, D], block_tables [>=B, M] int64,
             seq_lens [B] int64, block_size, scale, k_scale=None, v_scale=None)
    -> out [B, H, D] float32; k_scale, v_scale: float32 [K], for an fp8 (e4m3) cache

paged_prefill(q [T, H, D] bf16, k_cache, v_cache [num_slots, K, D] bf16, block_tables [S, M],
              query_start [S + 1] int64, context_lens [S] int64, block_size, scale)
    -> out [T, H, D] float32: every prompt chunk of a step (row i of sequence s at position
    context_lens[s] + i attends positions 0 .. its own), read from the cache in place
    (servelm/cpu_kernels/prefill_attention.cpp); bfloat16 with avx512_bf16 only

paged_decode_mla(q [B, H, E], cache [num_slots, E], block_tables, seq_lens, block_size, scale,
                 latent_dim L) -> out [B, H, L] float32: multi-head latent attention decodes
    over [latent | rope key] entries (servelm/cpu_kernels/mla_attention.cpp)
"""

from __future__ import annotations

from typing import Callable

import torch

from servelm import cpu_kernels

PART = "attention"  # of CpuKernelChoice
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)  # fp16: the torch path


def decode_kernel_for(cache: torch.Tensor, mode: str | None = None) -> Callable | None:
    """The kernel for decodes over `cache` (a K or V pool, [..., K, D]), or None where the
    torch path must run: not the CPU, an fp16 cache, D not a multiple of 16 (or over
    256), mode 'torch', or a failed build in mode 'auto'. mode None: the process's choice."""
    mode = cpu_kernels.mode(PART) if mode is None else mode
    if mode not in cpu_kernels.MODES:  # a bad value is an error whatever the cache
        raise ValueError(f"cpu_kernels: {PART}={mode!r}: choose one of {cpu_kernels.MODES}")
    head_dim = cache.shape[-1]
    if (cache.device.type != "cpu" or cache.dtype not in CACHE_DTYPES
            or head_dim % 16 or head_dim > 256):
        return None
    ops = cpu_kernels.ops_for_mode(PART, mode)
    return None if ops is None else ops.paged_decode


def prefill_kernel_for(cache: torch.Tensor, mode: str | None = None) -> Callable | None:
    """The kernel for prompt chunks over `cache`, or None where the torch path (SDPA per
    sequence) must run: not the CPU, not bfloat16, D not a multiple of 32 (or over 256),
    mode 'torch', a failed build in mode 'auto', or no usable avx512_bf16 (the kernel is
    built for it alone; the probe in isa.py must have seen vdpbf16ps run)."""
    mode = cpu_kernels.mode(PART) if mode is None else mode
    if mode not in cpu_kernels.MODES:
        raise ValueError(f"cpu_kernels: {PART}={mode!r}: choose one of {cpu_kernels.MODES}")
    head_dim = cache.shape[-1]
    if (cache.device.type != "cpu" or cache.dtype != torch.bfloat16 or head_dim % 32
            or head_dim > 256):
        return None
    ops = cpu_kernels.ops_for_mode(PART, mode)
    if ops is None or not ops.paged_prefill_available():
        return None
    return ops.paged_prefill


MLA_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def mla_decode_kernel_for(cache: torch.Tensor, mode: str | None = None) -> Callable | None:
    """The kernel for MLA decodes over `cache` ([num_slots, 1, E] entries, any E), or None
    where the torch path must run: not the CPU, not float32/bfloat16, mode 'torch', or a
    failed build in mode 'auto'."""
    mode = cpu_kernels.mode(PART) if mode is None else mode
    if mode not in cpu_kernels.MODES:
        raise ValueError(f"cpu_kernels: {PART}={mode!r}: choose one of {cpu_kernels.MODES}")
    if cache.device.type != "cpu" or cache.dtype not in MLA_CACHE_DTYPES:
        return None
    ops = cpu_kernels.ops_for_mode(PART, mode)
    return None if ops is None else ops.paged_decode_mla
