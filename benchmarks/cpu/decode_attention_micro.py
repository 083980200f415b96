"""Micro-benchmark: one layer of decode attention, C++ paged kernel vs gather + SDPA.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head dim 64), 64 decodes with contexts drawn
from 100..400 tokens, blocks of 16 handed out in a scrambled order. Both paths run through
TorchAttentionBackend.forward (the K/V store included), interleaved A/B in one process, at 1
and 2 threads; build_metadata (once per step, not per layer) is timed apart. glibc keeps
freed memory as in the engine (servelm/runner/host_memory.py).

    .venv/bin/python benchmarks/cpu/decode_attention_micro.py [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import ModelConfig
from servelm.runner.host_memory import keep_freed_memory

H, K, D, BLOCK = 9, 3, 64, 16


def make_step(batch: int, lo: int, hi: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    blocks = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(blocks) + 64, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for n, nb in zip(lens, blocks):
        table = order[used:used + nb]
        used += nb
        tables.append(table + [0] * (max(blocks) - nb))
        slots.append(table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    fb = ForwardBatch(input_ids=long([0] * batch), positions=long([n - 1 for n in lens]),
                      slot_mapping=long(slots), block_tables=long(tables),
                      query_start_loc=list(range(batch + 1)), context_lens=[n - 1 for n in lens],
                      seq_lens=lens, num_decodes=batch, block_size=BLOCK,
                      logits_indices=long(list(range(batch))))
    return fb, len(order), sum(lens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", default="100:400")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    keep_freed_memory()  # as the engine does: the torch path's gathered copies reuse memory
    dtype = getattr(torch, args.dtype)
    lo, hi = map(int, args.context.split(":"))
    fb, num_blocks, num_ctx = make_step(args.batch, lo, hi, seed=0)
    config = ModelConfig("llama", 32, H * D, 4 * H * D, 1, H, K, D, 4096)
    backends, caches = {}, {}
    for path in ("torch", "kernel"):
        caches[path] = KVCache(config, num_blocks, BLOCK, dtype, torch.device("cpu"))
        backends[path] = TorchAttentionBackend(caches[path], H, D ** -0.5,
                                               decode_kernel_mode=path)
    assert backends["kernel"].decode_kernel is not None, "the C++ decode kernel did not load"
    assert backends["torch"].decode_kernel is None
    for name in ("k", "v"):  # the same contents in both (each path reads its own copy)
        getattr(caches["torch"], name).normal_()
        getattr(caches["kernel"], name).copy_(getattr(caches["torch"], name))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(args.batch, H, D, generator=gen).to(dtype)
    k = torch.randn(args.batch, K, D, generator=gen).to(dtype)
    v = torch.randn(args.batch, K, D, generator=gen).to(dtype)
    print(f"B={args.batch} contexts {lo}..{hi} ({num_ctx} tokens), H={H} K={K} D={D}, "
          f"{args.dtype}; load {open('/proc/loadavg').read().split()[:3]}")
    with torch.inference_mode():
        metas = {p: b.build_metadata(fb) for p, b in backends.items()}
        fb.attn_metadata = metas["torch"]
        ref = backends["torch"].forward(0, q, k, v, fb)
        fb.attn_metadata = metas["kernel"]
        err = (backends["kernel"].forward(0, q, k, v, fb) - ref).abs().max().item()
        print(f"max |kernel - torch| = {err:.2e}")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = {p: [] for p in backends}
            meta_times = {p: [] for p in backends}
            for _ in range(args.rounds):
                for path, backend in backends.items():  # interleaved A/B
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        backend.build_metadata(fb)
                    meta_times[path].append((time.perf_counter() - t0) / args.iters)
                    fb.attn_metadata = metas[path]
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        backend.forward(0, q, k, v, fb)
                    times[path].append((time.perf_counter() - t0) / args.iters)
            med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            for path in backends:
                print(f"threads={threads} {path:6s} layer {med[path]:7.3f} ms "
                      f"(min {min(times[path]) * 1e3:.3f}, max {max(times[path]) * 1e3:.3f}); "
                      f"metadata/step {statistics.median(meta_times[path]) * 1e3:.3f} ms")
            print(f"threads={threads} speedup per layer {med['torch'] / med['kernel']:.1f}x; "
                  f"30 layers: {30 * med['torch']:.1f} -> {30 * med['kernel']:.1f} ms/step")


if __name__ == "__main__":
    main()
