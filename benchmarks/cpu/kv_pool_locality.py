"""Decode speed on KV pools whose free lists a long-running server's traffic has shaped:
does the order in which the block allocator hands out ids slow a server down as it ages?

One engine (default model, no prefix cache, the default KV pool) and one measured workload
(48 seeded prompts of 130-500 tokens, 128 new tokens each, greedy). Before each measurement
the engine's free list is set to one of these orders (the engine holds no blocks then):

  fresh       0, 1, 2, ...: a new server's
  fifo-aged   a first-in-first-out free list after `--age-requests` served requests
              (continuous batching of 40 at a time, prompts of 130-500 tokens, 64-128 new
              tokens, finishing in another order than they started): servelm's list until
              it became a stack
  stack-aged  the same traffic on a stack (a freed block is the next one taken): the
              BlockManager's list now, aged by driving the BlockManager itself
  scrambled   every block in a random place: the worst case of a list that walks the pool

The orders run in turn, `--rounds` times. Each measurement notes the span of the block ids
its sequences took (the highest id and the count of distinct ids).

Writes `<label>.json` (command, machine, commit, output tok/s and block span of each
measurement) and `<label>.png` into --out.

    .venv/bin/python benchmarks/cpu/kv_pool_locality.py --out DIR [--label NAME]
"""

from __future__ import annotations

import argparse
import collections
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


def _served_traffic(rng: random.Random, num_requests: int, block_size: int,
                    concurrency: int = 40):
    """Yield ("take", seq, n) and ("free", seq) events of continuous batching: prompts of
    130-500 tokens take their blocks at once, each decode step a block where a sequence
    crosses a block boundary, and sequences finish after 64-128 new tokens."""
    live, started, done = [], 0, 0
    while done < num_requests:
        while len(live) < concurrency and started < num_requests:
            n = rng.randrange(130, 500)
            live.append([started, n, rng.randrange(64, 128)])
            yield "take", started, -(-n // block_size)
            started += 1
        for s in list(live):
            if s[1] % block_size == 0:
                yield "take", s[0], 1
            s[1] += 1
            s[2] -= 1
            if s[2] == 0:
                live.remove(s)
                yield "free", s[0], 0
                done += 1
    for s in live:
        yield "free", s[0], 0


def _fifo_aged(num_blocks: int, block_size: int, num_requests: int) -> list[int]:
    """The free list of servelm's former allocator (take from the left, free to the right,
    newest block first) after the traffic."""
    free, tables = collections.deque(range(num_blocks)), {}
    for kind, seq, n in _served_traffic(random.Random(1), num_requests, block_size):
        if kind == "take":
            tables.setdefault(seq, []).extend(free.popleft() for _ in range(n))
        else:
            free.extend(reversed(tables.pop(seq)))
    return list(free)


def _stack_aged(num_blocks: int, block_size: int, num_requests: int) -> list[int]:
    """The free list of the BlockManager itself after the same traffic."""
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.sequence import Sequence
    from servelm.protocol import RequestTimings, SamplingParams

    bm, seqs = BlockManager(num_blocks, block_size), {}
    params = SamplingParams(max_tokens=1)
    for kind, seq, n in _served_traffic(random.Random(1), num_requests, block_size):
        if kind == "free":
            bm.free(seqs.pop(seq))
        elif seq not in seqs:
            s = seqs[seq] = Sequence(str(seq), seq, [1] * (n * block_size), params,
                                     RequestTimings(0.0), 1 << 20)
            bm.allocate(s, n * block_size)
        else:
            bm._append_fresh(seqs[seq].block_table, n)
    return list(bm._free)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--label", default=None, help="name of this run (default: the commit)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--age-requests", type=int, default=1600,
                   help="served requests that shape the aged free lists")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(a.model, num_threads=a.threads, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randrange(130, 500))]
               for _ in range(a.num_prompts)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels, first-touch of the first blocks
    scrambled = list(range(bm.num_blocks))
    random.Random(2).shuffle(scrambled)
    orders = {"fresh": list(range(bm.num_blocks)),
              "fifo-aged": _fifo_aged(bm.num_blocks, bm.block_size, a.age_requests),
              "stack-aged": _stack_aged(bm.num_blocks, bm.block_size, a.age_requests),
              "scrambled": scrambled}
    runs = {name: [] for name in orders}
    for i in range(a.rounds):
        for name, order in orders.items():
            assert len(bm._free) == bm.num_blocks, "the engine holds blocks between runs"
            bm._free = collections.deque(order)
            runs[name].append(_measure(llm, prompts, a.max_tokens))
        print(f"round {i + 1}: " + ", ".join(f"{n} {runs[n][-1]['output_tok_s']:.1f}"
                                             for n in orders) + " tok/s", file=sys.stderr)
    commit = git_commit()
    label = a.label or commit[:12]
    result = {"kind": "kv_pool_locality", "label": label, "command": " ".join(sys.argv),
              "machine": machine_info(threads=a.threads), "commit": commit,
              "threads": a.threads, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
              "num_blocks": bm.num_blocks, "age_requests": a.age_requests,
              "runs": runs,
              "median_tok_s": {k: statistics.median(r["output_tok_s"] for r in v)
                               for k, v in runs.items()}}
    (out / f"{label}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out}/{label}.json", file=sys.stderr)
    plot(out / f"{label}.json")


def plot(path: Path) -> None:
    """Each order's median as a bar, every round as a dot, the block span written under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(path.read_text())
    names = list(run["runs"])
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(range(len(names)), [run["median_tok_s"][n] for n in names], 0.6,
                  color="#9bbbd9")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    for i, n in enumerate(names):
        ax.plot([i] * len(run["runs"][n]), [r["output_tok_s"] for r in run["runs"][n]], "k.")
    ax.set_xticks(range(len(names)),
                  [f"{n}\nids up to {max(r['highest_block'] for r in run['runs'][n])}"
                   for n in names], fontsize=8)
    ax.set_ylabel("output tok/s (bar: median of rounds)")
    ax.set_title(f"{run['num_prompts']} prompts x {run['max_tokens']} tokens, "
                 f"{run['num_blocks']}-block pool; {run['machine'].get('cpu', 'CPU')}, "
                 f"{run['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
