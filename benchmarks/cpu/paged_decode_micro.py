"""Micro-benchmark: the C++ paged decode kernel (servelm_cpu::paged_decode) alone, per KV cache
dtype, at the default model's shapes: 9 query heads, 3 KV heads, head dim 64, blocks of 16
in a scrambled order, 64 sequences of one context length (q float32, bfloat16 with a
bfloat16 cache, as a bfloat16 model's), one pool per layer for 30 layers
(each step reads every layer's K and V from memory, as a decode step does), and the same
work on one small pool that stays in cache (what the arithmetic alone costs).

Writes `<label>.json` (command, machine, commit, ms per 30-layer pass, GB/s, positions x KV
heads per second) into --out; `--plot` draws every JSON in --out into plot.png, so runs of
two commits (each from its own checkout: `git worktree add /tmp/old COMMIT`, then this script
from there with the same --out) land side by side in one record.

    .venv/bin/python benchmarks/cpu/paged_decode_micro.py --out DIR --label NAME [--plot]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from servelm import cpu_kernels
from servelm.bench.results import git_commit, machine_info

H, K, D, BLOCK, LAYERS = 9, 3, 64, 16, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _pools(batch: int, ctx: int, layers: int, dtype: torch.dtype, gen: torch.Generator):
    blocks = batch * -(-ctx // BLOCK)
    pools = []
    for _ in range(layers):
        k, v = (torch.randn(blocks * BLOCK, K, D, generator=gen) * 0.5 for _ in range(2))
        pools.append((k.to(dtype), v.to(dtype)))
    tables = torch.randperm(blocks, generator=gen).view(batch, -1).contiguous()
    return pools, tables


def _pass_ms(ops, q, pools, tables, lens, scales, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        for k, v in pools:
            ops.paged_decode(q, k, v, tables, lens, BLOCK, D ** -0.5, *scales)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--label", default=None, help="name of this run (default: the commit)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=208)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--plot", action="store_true", help="draw every run in --out, then exit")
    a = p.parse_args()
    out = Path(a.out)
    if a.plot:
        return plot(out)
    torch.set_num_threads(a.threads)
    ops = cpu_kernels.ops_for_mode("attention", "kernel")
    gen = torch.Generator().manual_seed(0)
    lens = torch.full((a.batch,), a.context, dtype=torch.int64)
    q = torch.randn(a.batch, H, D, generator=gen)
    cases = []
    for name, dtype in DTYPES.items():
        scales = (torch.ones(K), torch.ones(K)) if name == "fp8" else (None, None)
        for where, layers in (("memory", LAYERS), ("cache", 1)):
            pools, tables = _pools(a.batch if where == "memory" else 4, a.context, layers,
                                   dtype, gen)
            reps = 1 if where == "memory" else LAYERS * a.batch // 4
            qq, ll = (q, lens) if where == "memory" else (q[:4].contiguous(), lens[:4])
            if dtype == torch.bfloat16:  # a bfloat16 model's q is bfloat16 too
                qq = qq.to(torch.bfloat16)
            _pass_ms(ops, qq, pools, tables, ll, scales, reps)  # warm
            ms = statistics.median(_pass_ms(ops, qq, pools, tables, ll, scales, reps)
                                   for _ in range(a.rounds))
            kv_bytes = 2 * LAYERS * a.batch * a.context * K * D * pools[0][0].element_size()
            work = LAYERS * a.batch * a.context * K  # positions x KV heads per pass
            cases.append({"cache_dtype": name, "context_in": where, "ms_per_pass": ms,
                          "kv_gb_s": kv_bytes / ms / 1e6, "positions_x_kv_heads_per_s":
                          work / ms * 1e3})
            print(f"{name:9s} context in {where:6s}: {ms:7.1f} ms per 30-layer pass, "
                  f"{kv_bytes / ms / 1e6:5.1f} GB/s", file=sys.stderr)
    commit = git_commit()
    label = a.label or (commit or "unknown")[:7]
    out.mkdir(parents=True, exist_ok=True)
    result = {"kind": "paged_decode_micro", "label": label,
              "command": " ".join(["python", *sys.argv]), "machine": machine_info(a.threads),
              "commit": commit, "threads": a.threads, "batch": a.batch,
              "context": a.context, "layers": LAYERS, "shape": {"H": H, "K": K, "D": D,
                                                                 "block": BLOCK},
              "rounds": a.rounds, "cases": cases}
    (out / f"{label}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out}/{label}.json", file=sys.stderr)


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(runs))
    names = list(DTYPES)
    for i, run in enumerate(runs):
        ms = {c["cache_dtype"]: c["ms_per_pass"] for c in run["cases"]
              if c["context_in"] == "memory"}
        xs = [j + i * width for j in range(len(names))]
        bars = ax.bar(xs, [ms[n] for n in names], width, label=f"{run['label']}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel("ms per step (30 layers, context from memory)")
    r0 = runs[0]
    ax.set_title(f"paged decode, {r0['batch']} seqs x {r0['context']} positions; "
                 f"{r0['machine'].get('cpu', 'CPU')}, {r0['threads']} threads", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    print(f"wrote {out}/plot.png", file=sys.stderr)


if __name__ == "__main__":
    main()
