"""A decode step through the C++ stack whole against in two slices of rows, a thread each
(DecodeStack.run_parts; servelm/runner/cpu_decode.py decides when a step splits), at several
batch sizes: the default model, default engine, 2 threads.

For each row count B: B prompts of 32..256 tokens (seed 0) decode 128 tokens; the 60th
all-decode step is kept and run again through the stack `--reps` times each way, alternating
(the same K/V rows are written again, so every run computes the same bits; checked), in two
slices whether or not the policy (row_parts) would split that many rows. Writes
`decode-row-split.json` (command, machine, commit, per B the median and spread of each way)
and `decode-row-split.png` into --out.

    .venv/bin/python benchmarks/cpu/decode_row_split.py --out DIR [--rows 32,40,48,64,128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from servelm.bench.results import git_commit, machine_info

MODEL = "smollm2-135m-instruct"
STEP = 60


def measure(rows: int, reps: int) -> dict:
    from servelm import LLM
    from servelm.bench.offline import _generate, warmup_requests
    from servelm.bench.workloads import random_lengths
    from servelm.runner import cpu_decode

    llm = LLM(MODEL, max_num_seqs=max(64, rows), seed=0)
    _generate(llm, warmup_requests(llm.engine.vocab_size, 0), progress=False)
    stack = llm.engine.runner.cpu_stack
    kept, seen = {}, [0]
    run = cpu_decode.CpuDecodeStack.maybe_run

    def keep(self, fb, num_layers=None):
        if fb.num_decodes == fb.num_seqs == rows:
            seen[0] += 1
            if seen[0] == STEP:
                kept["fb"] = fb
        return run(self, fb, num_layers)

    cpu_decode.CpuDecodeStack.maybe_run = keep
    try:
        _generate(llm, random_lengths(rows, (32, 256), (128, 128), llm.engine.vocab_size, 0),
                  progress=False)
    finally:
        cpu_decode.CpuDecodeStack.maybe_run = run
    fb, policy = kept["fb"], cpu_decode.row_parts
    threads = torch.get_num_threads()
    # "slices" at every row count (the policy's minimum lifted, to show what it avoids);
    # "whole": never split
    ways = {"whole": lambda lens, n: [0, len(lens)],
            "slices": lambda lens, n: policy(lens, n, min_rows=1)}
    times = {way: [] for way in ways}
    reference, splits = None, stack.split_steps
    try:
        with torch.inference_mode():
            for _ in range(reps):
                for way, parts in ways.items():
                    cpu_decode.row_parts = parts
                    t0 = time.perf_counter()
                    hidden = run(stack, fb)
                    times[way].append((time.perf_counter() - t0) * 1e3)
                    if reference is None:
                        reference = hidden.clone()
                    elif not torch.equal(hidden, reference):
                        raise SystemExit(f"{rows} rows: the {way} step computed other bits")
    finally:
        cpu_decode.row_parts = policy
    if stack.split_steps - splits != reps:  # e.g. not DotLinears: no avx512_bf16 here
        raise SystemExit(f"{rows} rows: {stack.split_steps - splits} of {reps} runs split")
    return {"rows": rows, "policy_splits": len(policy(list(fb.seq_lens), threads)) > 2,
            "bounds": policy(list(fb.seq_lens), threads, min_rows=1),
            **{f"{way}_ms": {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for way, v in times.items()}}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(runs))
    for j, (way, label) in enumerate((("whole", "whole step"), ("slices", "two slices"))):
        med = [r[f"{way}_ms"]["median"] for r in runs]
        lo = [m - r[f"{way}_ms"]["min"] for m, r in zip(med, runs)]
        hi = [r[f"{way}_ms"]["max"] - m for m, r in zip(med, runs)]
        ax.bar([x + 0.4 * j for x in xs], med, 0.4, yerr=[lo, hi], label=label, capsize=2)
    ax.set_xticks([x + 0.2 for x in xs], [f"{r['rows']} rows" + ("\n(split)" if
                                          r["policy_splits"] else "") for r in runs])
    ax.set_ylabel("decode step through the stack, ms")
    ax.set_title(f"{record['machine'].get('cpu', 'CPU')}, {record['machine'].get('threads')} "
                 "threads: median, min-max", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="32,40,48,64,128")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        runs.append(measure(rows, args.reps))
        r = runs[-1]
        print(f"{rows} rows: whole {r['whole_ms']['median']:.2f} ms, slices "
              f"{r['slices_ms']['median']:.2f} ms (the policy splits: "
              f"{r['policy_splits']})", file=sys.stderr)
    record = {"kind": "decode_row_split", "command": "python " + " ".join(sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(), "model": MODEL,
              "step": STEP, "reps": args.reps, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-row-split.json").write_text(json.dumps(record, indent=1))
    plot(record, out / "decode-row-split.png")
    print(f"wrote {out}/decode-row-split.json and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
