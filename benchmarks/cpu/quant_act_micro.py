"""Micro-benchmark: the quantized CPU linears with float32 activations (quant_gemm.cpp) against
int8 activations (quant_gemm_a8.cpp, avx512_vnni dot products), on SmolLM2-135M's shapes.

Shapes (out x in): qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536, and the
tied head 49152 x 576. Formats: int4-g32 (the default GGUF's Q4_1 blocks: float32 scale and
zero per 32) and int8-g32 (Q8_0, and the head servelm builds for every quantized model); the
head also as float32 (at::linear on the float weight) for scale. M = 1, 4 and 64 rows (one
decode, a few, a prefill chunk). Each case runs both kernels interleaved A/B in one process
at the thread count given, on random codes; median of the rounds. A per-token summary adds
the four block shapes x 30 layers plus the head at M = 1. Scales as the gguf layers keep
them: float32 (scale, zero) for float activations, float16 (d, m) for int8. Writes result.json (command,
machine, commit) and plot.png under benchmarks/results/quant-act-micro-<UTC ts>/.

    .venv/bin/python benchmarks/cpu/quant_act_micro.py [--threads 2] [--rounds 7]
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
from servelm.quant.cpu_panels import (pack_int4_panels, pack_int4_vnni, pack_int8_panels,
                                      pack_int8_vnni)
from servelm.quant.int8_act import int8_dot_usable
from servelm.runner.host_memory import keep_freed_memory

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
LAYERS = 30
ROWS = (1, 4, 64)


def _cases(name: str, n: int, k: int):
    """{format: {"float": fn(x), "int8": fn(x)}} for one shape (the head adds float32)."""
    ops = torch.ops.servelm_cpu
    gen = torch.Generator().manual_seed(n + k)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale, zero = torch.rand(n, k // 32, generator=gen) * 0.01, torch.randn(n, k // 32) * 0.01
    c4, sz = pack_int4_panels(q4, scale, zero, torch.float32)  # gguf's float-activation layers
    c4v = pack_int4_vnni(q4)
    so = pack_int4_panels(q4, scale, zero - 8 * scale, torch.float16)[1]  # and int8's (d, m)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    c8, s8 = pack_int8_panels(q8, scale)
    c8v = pack_int8_vnni(q8)
    s8h = s8.half()  # Q8_0's d as the int8-activation layers keep it
    cases = {
        "int4-g32": {"float": lambda x: ops.int4_gemm(x, c4, sz, n, 32),
                     "int8": lambda x: ops.int4_gemm_a8(x, c4v, so, n, 32)},
        "int8-g32": {"float": lambda x: ops.int8_gemm(x, c8, s8, n, 32),
                     "int8": lambda x: ops.int8_gemm_a8(x, c8v, s8h, n, 32)},
    }
    if name == "head":
        w = torch.randn(n, k, generator=gen)
        cases["float32"] = {"float": lambda x: torch.nn.functional.linear(x, w)}
    return cases


def _time(fn, x, budget_s: float) -> float:
    """Seconds per call: as many calls as fit the budget (at least 3), after one warm-up."""
    fn(x)
    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < budget_s:
        fn(x)
        calls += 1
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-ms", type=float, default=40.0, help="per case and round")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/"
                    "quant-act-micro-<UTC ts>")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    cpu_kernels.load()
    if not int8_dot_usable():
        sys.exit("this CPU does not run avx512_vnni: there is no int8-activation kernel to time")
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            cases = _cases(name, n, k)
            for m in ROWS:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                for fmt, fns in cases.items():
                    times = {a: [] for a in fns}
                    for _ in range(args.rounds):  # interleaved A/B
                        for act, fn in fns.items():
                            times[act].append(_time(fn, x, args.budget_ms / 1e3))
                    row = {"shape": name, "n": n, "k": k, "m": m, "format": fmt,
                           **{f"{a}_us": round(statistics.median(t) * 1e6, 2)
                              for a, t in times.items()}}
                    if "int8_us" in row:
                        row["speedup"] = round(row["float_us"] / row["int8_us"], 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = _per_token(rows)
    print(json.dumps(summary, indent=1))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out_dir or f"benchmarks/results/quant-act-micro-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "quant-act-micro", "command": " ".join([sys.executable] + sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(),
              "created": stamp, "threads": args.threads, "rounds": args.rounds,
              "rows": rows, "per_token_m1": summary}
    (out / "result.json").write_text(json.dumps(record, indent=2) + "\n")
    _plot(rows, out / "plot.png")
    print(f"wrote {out}")


def _per_token(rows) -> dict:
    """ms of one decode token's linears (M = 1): 30 layers of int4 blocks + the int8 head."""
    at = {(r["shape"], r["format"]): r for r in rows if r["m"] == 1}
    out = {}
    for act in ("float", "int8"):
        blocks = sum(at[(s, "int4-g32")][f"{act}_us"] for s in ("qkv", "o", "gate_up", "down"))
        out[f"{act}_activations_ms"] = round((LAYERS * blocks + at[("head", "int8-g32")]
                                              [f"{act}_us"]) / 1e3, 3)
    out["head_float32_ms"] = round(at[("head", "float32")]["float_us"] / 1e3, 3)
    return out


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ROWS), figsize=(5 * len(ROWS), 4))
    for ax, m in zip(axes, ROWS):
        sel = [r for r in rows if r["m"] == m and "int8_us" in r]
        labels = [f"{r['shape']}\n{r['format']}" for r in sel]
        xs = range(len(sel))
        ax.bar([i - 0.2 for i in xs], [r["float_us"] for r in sel], 0.4, label="float32 act")
        ax.bar([i + 0.2 for i in xs], [r["int8_us"] for r in sel], 0.4, label="int8 act (VNNI)")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=45)
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(f"M = {m}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
