"""Micro-benchmark: one layer of MLA decode attention, the C++ latent kernel against the torch
path (gather of the context's entries + SDPA), through TorchAttentionBackend.forward_mla.

DeepSeek-V2-Lite's attention shape: 16 heads, a latent of 512 and a rope key of 64 (entries
of 576 values), blocks of 16 handed out in a scrambled order. Batches of 1, 8 and 32 decodes
at contexts of 512 and 2048 tokens, interleaved A/B in one process at the thread count
given; the entry store is included. Writes JSON (with command, machine and commit) and a PNG.

    python benchmarks/cpu/mla_decode_micro.py --out benchmarks/results/mla-decode-<ts>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.bench.results import git_commit, machine_info
from servelm.config import ModelConfig
from servelm.runner.host_memory import keep_freed_memory

H, LATENT, ROPE, BLOCK = 16, 512, 64, 16


def _step(batch: int, context: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nb = -(-context // BLOCK)
    order = torch.randperm(batch * nb + 8, generator=gen)
    tables = order[:batch * nb].view(batch, nb).long()
    pos = context - 1
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
    long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    fb = ForwardBatch(input_ids=long([0] * batch), positions=long([pos] * batch),
                      slot_mapping=slots, block_tables=tables,
                      query_start_loc=list(range(batch + 1)), context_lens=[pos] * batch,
                      seq_lens=[context] * batch, num_decodes=batch, block_size=BLOCK,
                      logits_indices=long(list(range(batch))))
    return fb, batch * nb + 8


def _time(backend, fb, entry, q, empty_q, iters: int) -> float:
    fb.attn_metadata = backend.build_metadata(fb)
    t0 = time.perf_counter()
    for _ in range(iters):
        backend.forward_mla(0, entry, fb, q, empty_q, None, (LATENT + ROPE) ** -0.5, LATENT)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    config = ModelConfig("deepseek2", 32, 2048, 4096, 1, H, H, 192, 4096, kv_lora_rank=LATENT,
                         qk_rope_head_dim=ROPE, qk_nope_head_dim=128, v_head_dim=128)
    rows = []
    with torch.inference_mode():
        for context in (512, 2048):
            for batch in (1, 8, 32):
                fb, num_blocks = _step(batch, context, seed=batch + context)
                cache = KVCache(config, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
                cache.k.normal_()
                backend = TorchAttentionBackend(cache, H, 1.0)
                kernel = backend.mla_decode_kernel
                assert kernel is not None, "the C++ kernels did not build"
                gen = torch.Generator().manual_seed(1)
                q = torch.randn(batch, H, LATENT + ROPE, generator=gen)
                entry = torch.randn(batch, LATENT + ROPE, generator=gen)
                empty_q = q.new_empty(0, H, 192)
                times = {"kernel": [], "torch": []}
                for _ in range(args.rounds):  # interleaved A/B
                    backend.mla_decode_kernel = kernel
                    times["kernel"].append(_time(backend, fb, entry, q, empty_q, args.iters))
                    backend.mla_decode_kernel = None
                    times["torch"].append(_time(backend, fb, entry, q, empty_q, args.iters))
                backend.mla_decode_kernel = kernel
                fb.attn_metadata = backend.build_metadata(fb)
                a = backend.forward_mla(0, entry, fb, q, empty_q, None, 0.04, LATENT)[0]
                backend.mla_decode_kernel = None
                b = backend.forward_mla(0, entry, fb, q, empty_q, None, 0.04, LATENT)[0]
                med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
                row = {"batch": batch, "context": context, "kernel_ms": round(med["kernel"], 3),
                       "torch_ms": round(med["torch"], 3),
                       "speedup": round(med["torch"] / med["kernel"], 2),
                       "max_abs_diff": float((a - b).abs().max()),
                       "cache_bytes_read": batch * context * (LATENT + ROPE) * 4}
                rows.append(row)
                print(json.dumps(row), flush=True)
    record = {"benchmark": "mla-decode-micro", "command": " ".join([sys.executable] + sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(),
              "shape": {"heads": H, "latent": LATENT, "rope": ROPE, "block_size": BLOCK,
                        "dtype": "float32"}, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, context in zip(axes, (512, 2048)):
        sel = [r for r in rows if r["context"] == context]
        xs = [r["batch"] for r in sel]
        ax.plot(xs, [r["kernel_ms"] for r in sel], "o-", label="C++ latent kernel")
        ax.plot(xs, [r["torch_ms"] for r in sel], "s-", label="gather + SDPA")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decodes in the step")
        ax.set_ylabel("ms per layer")
        ax.set_title(f"MLA decode, context {context} (H={H}, latent {LATENT}+{ROPE})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
