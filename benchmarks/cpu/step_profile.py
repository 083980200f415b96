"""Where the offline batch's engine steps go: the torch profiler on chosen steps of the
best-against-best batch (64 prompts of 32..256 tokens, seed 0, 128 new tokens each, default
model, default engine), and every step's wall time.

Writes `<label>.json` (command, machine, commit; per profiled step its shape, wall time and
each op's self CPU ms) into --out; `--plot` draws every JSON in --out into plot.png, so runs
of two commits (each from its own checkout, this script run with PYTHONPATH at that
checkout) land side by side in one record.

    .venv/bin/python benchmarks/cpu/step_profile.py --out DIR --label NAME [--steps 1,60]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from servelm.bench.results import git_commit, machine_info

MODEL = "smollm2-135m-instruct"


def profile(steps: set[int], threads: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from servelm import LLM
    from servelm.bench.offline import _generate, warmup_requests
    from servelm.bench.workloads import random_lengths

    torch.set_num_threads(threads)
    llm = LLM(MODEL, max_num_seqs=64, seed=0)
    _generate(llm, warmup_requests(llm.engine.vocab_size, 0), progress=False)
    runner = llm.engine.runner
    execute, walls, profiled = runner.execute, [], {}

    def timed(step):
        i = len(walls)
        t0 = time.perf_counter()
        if i in steps:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                result = execute(step)
            ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()
                   if e.self_cpu_time_total > 0}
            profiled[i] = {"tokens": step.num_batched_tokens, "seqs": len(step.seqs),
                           "op_self_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
        else:
            result = execute(step)
        walls.append({"tokens": step.num_batched_tokens, "seqs": len(step.seqs),
                      "ms": (time.perf_counter() - t0) * 1e3})
        return result

    runner.execute = timed
    t0 = time.perf_counter()
    _generate(llm, random_lengths(64, (32, 256), (128, 128), llm.engine.vocab_size, 0),
              progress=False)
    elapsed = time.perf_counter() - t0
    decode = [w["ms"] for w in walls if w["tokens"] == w["seqs"]]
    return {"elapsed_s": elapsed, "steps": walls, "profiled": profiled,
            "decode_steps": len(decode), "decode_ms_mean": sum(decode) / len(decode),
            "other_steps_s": sum(w["ms"] for w in walls if w["tokens"] != w["seqs"]) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default=None)
    ap.add_argument("--steps", default="1,60", help="step indices to profile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", action="store_true", help="draw every run in --out, then exit")
    args = ap.parse_args()
    out = Path(args.out)
    if args.plot:
        return plot(out)
    run = profile({int(s) for s in args.steps.split(",")}, args.threads)
    commit = git_commit()
    label = args.label or (commit or "unknown")[:7]
    record = {"kind": "step_profile", "label": label, "command": "python " + " ".join(sys.argv),
              "machine": machine_info(args.threads), "commit": commit, "model": MODEL,
              "workload": "64 x (32:256 + 128), seed 0", **run}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.json").write_text(json.dumps(record, indent=1))
    print(f"{label}: {run['elapsed_s']:.2f} s, decode steps {run['decode_ms_mean']:.1f} ms "
          f"mean, prefill-bearing steps {run['other_steps_s']:.2f} s", file=sys.stderr)
    for i, p in run["profiled"].items():
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(p["op_self_ms"].items())[:6])
        print(f"  step {i} ({p['tokens']} tokens, {p['seqs']} seqs): {top}", file=sys.stderr)


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    steps = sorted({int(i) for r in runs for i in r["profiled"]})
    fig, axes = plt.subplots(1, len(steps), figsize=(6 * len(steps), 4), squeeze=False)
    for ax, step in zip(axes[0], steps):
        ops = {}
        for r in runs:
            for k, v in list(r["profiled"][str(step)]["op_self_ms"].items())[:6]:
                ops.setdefault(k, 0.0)
        names = list(ops)
        width = 0.8 / len(runs)
        for j, r in enumerate(runs):
            vals = [r["profiled"][str(step)]["op_self_ms"].get(n, 0.0) for n in names]
            ax.barh([i + j * width for i in range(len(names))], vals, width, label=r["label"])
        ax.set_yticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))],
                      [n.split("::")[-1] for n in names], fontsize=7)
        shape = runs[0]["profiled"][str(step)]
        ax.set_title(f"step {step}: {shape['tokens']} tokens, {shape['seqs']} seqs", fontsize=9)
        ax.set_xlabel("self CPU ms")
        ax.legend(fontsize=7)
    fig.suptitle(f"{runs[0]['machine'].get('cpu', 'CPU')}, {runs[0]['machine'].get('threads')} "
                 "threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    print(f"wrote {out}/plot.png", file=sys.stderr)


if __name__ == "__main__":
    main()
