"""Decode speed on a fresh KV pool against one aged by requests that came and went: does the
block allocator keep a long-running server as fast as a new one?

One engine (default model, no prefix cache, the default KV pool), one measured workload
(48 seeded prompts of 130-500 tokens, 128 new tokens each, greedy): measured on the fresh
pool, then after an ageing pass (requests of random lengths whose finishes interleave, more
blocks in all than the pool holds), again, alternating, `--rounds` times each. Each
measurement notes the span of the block ids its sequences held (the highest id taken and
the count of distinct ids).

Writes `<label>.json` (command, machine, commit, output tok/s and block span of each
measurement) into --out; `--plot` draws every JSON in --out into plot.png, so runs of two
commits (each from its own checkout: `git worktree add /tmp/old COMMIT`, then this script
from there with the same --out) land side by side in one record.

    .venv/bin/python benchmarks/cpu/kv_pool_locality.py --out DIR --label NAME [--plot]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from servelm import LLM, SamplingParams
from servelm.bench.results import git_commit, machine_info


def _measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    bm = llm.engine.block_manager
    taken: set[int] = set()
    allocate = bm._append_fresh

    def noting(table, needed):  # the ids each sequence is given, as it is given them
        before = len(table)
        allocate(table, needed)
        taken.update(table[before:])

    bm._append_fresh = noting
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t
    finally:
        del bm._append_fresh
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_s": tokens / dt, "seconds": dt, "blocks_taken": len(taken),
            "highest_block": max(taken)}


def _age(llm: LLM, rng: random.Random) -> int:
    """Requests of random prompt and output lengths, enough blocks in all to pass the whole
    pool: their finishes interleave, so a first-in-first-out free list ends scrambled."""
    bm = llm.engine.block_manager
    need, used, prompts, lens = bm.num_blocks * 1.2, 0, [], []
    while used < need:
        n, m = rng.randrange(100, 1500), rng.randrange(1, 48)
        prompts.append([rng.randrange(100, 40_000) for _ in range(n)])
        lens.append(m)
        used += -(-(n + m) // bm.block_size)
    for i in range(0, len(prompts), 64):
        llm.generate(prompts[i:i + 64], [SamplingParams(max_tokens=m, temperature=0,
                                                        ignore_eos=True)
                                         for m in lens[i:i + 64]], use_tqdm=False)
    return len(prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--label", default=None, help="name of this run (default: the commit)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plot", action="store_true", help="draw every run in --out, then exit")
    a = p.parse_args()
    out = Path(a.out)
    if a.plot:
        return plot(out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(a.model, num_threads=a.threads, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randrange(130, 500))]
               for _ in range(a.num_prompts)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels, first-touch of the first blocks
    runs = {"fresh": [], "aged": []}
    runs["fresh"].append(_measure(llm, prompts, a.max_tokens))
    aged_with = 0
    for i in range(a.rounds):
        if i:
            runs["fresh"].append(_measure(llm, prompts, a.max_tokens))
        aged_with += _age(llm, rng)
        runs["aged"].append(_measure(llm, prompts, a.max_tokens))
        print(f"round {i + 1}: fresh {runs['fresh'][-1]['output_tok_s']:.1f}, aged "
              f"{runs['aged'][-1]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    commit = git_commit()
    label = a.label or commit[:12]
    result = {"kind": "kv_pool_locality", "label": label, "command": " ".join(sys.argv),
              "machine": machine_info(threads=a.threads), "commit": commit,
              "threads": a.threads, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
              "num_blocks": llm.engine.block_manager.num_blocks, "ageing_requests": aged_with,
              "runs": runs,
              "median_tok_s": {k: statistics.median(r["output_tok_s"] for r in v)
                               for k, v in runs.items()}}
    (out / f"{label}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out}/{label}.json", file=sys.stderr)


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(runs))
    names = ["fresh", "aged"]
    for i, run in enumerate(runs):
        xs = [j + i * width for j in range(len(names))]
        bars = ax.bar(xs, [run["median_tok_s"][n] for n in names], width, label=run["label"])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(names))],
                  ["fresh pool", "aged pool"])
    ax.set_ylabel("output tok/s (median of rounds)")
    r0 = runs[0]
    ax.set_title(f"{r0['num_prompts']} prompts x {r0['max_tokens']} tokens, "
                 f"{r0['num_blocks']}-block pool; {r0['machine'].get('cpu', 'CPU')}, "
                 f"{r0['threads']} threads", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    print(f"wrote {out}/plot.png", file=sys.stderr)


if __name__ == "__main__":
    main()
