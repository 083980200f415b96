"""Micro-benchmark: one layer of prefill attention, the C++ prefill kernel against the torch
path (torch's flash kernel one sequence at a time, with the cached context gathered).

SmolLM2-135M shapes (9 query heads, 3 KV heads, head dim 64), a bfloat16 cache, blocks of 16
handed out in a scrambled order. Two steps: fresh prompts of 32..256 tokens filling a
2048-token step (what the offline batch's first steps are), and 64-token chunks after 0..1024
cached positions (chunked prefill of long prompts, prefix-cache hits). Both paths run through
TorchAttentionBackend.forward (the K/V store included), interleaved A/B, at 1 and 2 threads.

Writes `prefill-attention.json` (command, machine, commit, ms per layer per path) and a bar
plot beside it into --out.

    .venv/bin/python benchmarks/cpu/prefill_attention_micro.py --out DIR [--rounds 5]
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

H, K, D, BLOCK = 9, 3, 64, 16


def make_step(spans: list[tuple[int, int]], seed: int):
    """spans: (cached context, chunk rows) per sequence -> a prefill-only ForwardBatch."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + n) // BLOCK) for c, n in spans]
    order = torch.randperm(sum(blocks) + 64, generator=gen).tolist()
    tables, slots, positions, qsl, used = [], [], [], [0], 0
    for (ctx, n), nb in zip(spans, blocks):
        table = order[used:used + nb]
        used += nb
        tables.append(table + [0] * (max(blocks) - nb))
        positions += range(ctx, ctx + n)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
    long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    fb = ForwardBatch(input_ids=long([0] * qsl[-1]), positions=long(positions),
                      slot_mapping=long(slots), block_tables=long(tables), query_start_loc=qsl,
                      context_lens=[c for c, _ in spans], seq_lens=[c + n for c, n in spans],
                      num_decodes=0, block_size=BLOCK, logits_indices=long([qsl[-1] - 1]))
    return fb, len(order)


def fresh_spans(gen: torch.Generator, budget: int = 2048) -> list[tuple[int, int]]:
    spans, total = [], 0
    while total < budget:
        n = min(int(torch.randint(32, 257, (1,), generator=gen)), budget - total)
        spans.append((0, n))
        total += n
    return spans


def time_step(spans, rounds: int, iters: int) -> dict:
    fb, num_blocks = make_step(spans, seed=0)
    config = ModelConfig("llama", 32, H * D, 4 * H * D, 1, H, K, D, 4096)
    backends, caches = {}, {}
    for path in ("torch", "kernel"):
        caches[path] = KVCache(config, num_blocks, BLOCK, torch.bfloat16, torch.device("cpu"))
        backends[path] = TorchAttentionBackend(caches[path], H, D ** -0.5,
                                               decode_kernel_mode=path)
    if backends["kernel"].prefill_kernel is None:
        sys.exit("the prefill kernel does not run here (it needs a usable avx512_bf16)")
    for name in ("k", "v"):
        getattr(caches["torch"], name).normal_()
        getattr(caches["kernel"], name).copy_(getattr(caches["torch"], name))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(fb.num_tokens, h, D, generator=gen).bfloat16() for h in (H, K, K))
    result = {"spans": len(spans), "tokens": fb.num_tokens,
              "context_tokens": sum(c for c, _ in spans), "threads": {}}
    with torch.inference_mode():
        metas = {p: b.build_metadata(fb) for p, b in backends.items()}
        outs = {}
        for path, backend in backends.items():
            fb.attn_metadata = metas[path]
            outs[path] = backend.forward(0, q, k, v, fb).float()
        result["max_abs_diff"] = (outs["kernel"] - outs["torch"]).abs().max().item()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = {p: [] for p in backends}
            for _ in range(rounds):
                for path, backend in backends.items():  # interleaved A/B
                    fb.attn_metadata = metas[path]
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        backend.forward(0, q, k, v, fb)
                    times[path].append((time.perf_counter() - t0) / iters * 1e3)
            result["threads"][threads] = {
                p: {"ms_per_layer": statistics.median(t), "min": min(t), "max": max(t)}
                for p, t in times.items()}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    steps = {
        "fresh prompts 32..256, 2048 tokens": fresh_spans(gen),
        "64-token chunks after 0..1024 cached": [(int(c), 64) for c in
                                                 torch.randint(0, 1025, (16,), generator=gen)],
    }
    record = {"kind": "prefill_attention_micro", "command": "python " + " ".join(sys.argv),
              "machine": machine_info(), "commit": git_commit(),
              "shape": {"H": H, "K": K, "D": D, "block": BLOCK, "dtype": "bfloat16"},
              "rounds": args.rounds, "steps": {}}
    for name, spans in steps.items():
        r = record["steps"][name] = time_step(spans, args.rounds, args.iters)
        for threads, paths in r["threads"].items():
            t, kern = paths["torch"]["ms_per_layer"], paths["kernel"]["ms_per_layer"]
            print(f"{name}: threads={threads} torch {t:.2f} ms/layer, kernel {kern:.2f} "
                  f"({t / kern:.1f}x); max |diff| {r['max_abs_diff']:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill-attention.json").write_text(json.dumps(record, indent=1))
    plot(record, out / "prefill-attention.png")
    print(f"wrote {out / 'prefill-attention.json'}")


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["steps"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, (threads, path_name) in enumerate([(1, "torch"), (1, "kernel"), (2, "torch"),
                                              (2, "kernel")]):
        vals = [record["steps"][n]["threads"][threads][path_name]["ms_per_layer"]
                for n in names]
        ax.bar([x + (i - 1.5) * width for x in range(len(names))], vals, width,
               label=f"{path_name}, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per layer (median)")
    ax.set_title(f"prefill attention, one layer, bfloat16 cache ({record['machine']['cpu']}, "
                 f"{record['commit'][:7]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
