"""Micro-benchmark: bfloat16 linears on servelm's AMX tile GEMM (AmxLinear) against oneDNN's
packed bfloat16 GEMM (PackedLinear), at the default model's four layer shapes and its head,
for steps of 1 to 2048 rows. Weights in memory: 30 copies of each layer shape, one pass over
all of them as a decode step reads them (the head once), the median of --rounds passes.

Writes result.json (command, machine, commit, ms per pass and GB/s of weights for each form
and row count) and plot.png into --out.

    .venv/bin/python benchmarks/cpu/amx_linear_micro.py --out DIR [--threads 2]
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
from servelm.layers.amx_linear import AmxLinear, amx_usable
from servelm.layers.linear import PackedLinear

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 4, 16, 64, 256, 2048)


def _pass_ms(layers, head, xs, x_head) -> float:
    t = time.perf_counter()
    for per_layer in layers:
        for name, m in per_layer.items():
            m(xs[name])
    head(x_head)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not amx_usable():
        sys.exit("AMX-BF16 does not run here (servelm/layers/amx_linear.py: amx_usable)")
    gen = torch.Generator().manual_seed(0)
    weights = [{n: (torch.randn(o, i, generator=gen) * 0.02).bfloat16()
                for n, (o, i) in SHAPES.items()} for _ in range(LAYERS)]
    w_head = (torch.randn(*HEAD, generator=gen) * 0.02).bfloat16()
    nbytes = 2 * (sum(o * i for o, i in SHAPES.values()) * LAYERS + HEAD[0] * HEAD[1])
    cases = []
    for form, make in (("onednn", PackedLinear), ("amx", AmxLinear)):
        layers = [{n: make(w, None) for n, w in ws.items()} for ws in weights]
        head = make(w_head, None)
        for m in ROWS:
            xs = {n: torch.randn(m, i, generator=gen).bfloat16() for n, (o, i) in SHAPES.items()}
            x_head = torch.randn(min(m, 64), HEAD[1], generator=gen).bfloat16()
            _pass_ms(layers, head, xs, x_head)  # warm
            ms = statistics.median(_pass_ms(layers, head, xs, x_head) for _ in range(a.rounds))
            cases.append({"form": form, "rows": m, "ms_per_pass": ms,
                          "weights_gb_s": nbytes / ms / 1e6})
            print(f"{form:7s} {m:5d} rows: {ms:8.2f} ms per pass, {nbytes / ms / 1e6:5.1f} GB/s",
                  file=sys.stderr)
        del layers, head
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"kind": "amx_linear_micro", "command": " ".join(["python", *sys.argv]),
              "machine": machine_info(a.threads), "commit": git_commit(), "threads": a.threads,
              "layers": LAYERS, "shapes": SHAPES, "head": HEAD, "rounds": a.rounds,
              "note": "the head takes min(rows, 64) rows (a step's sampled rows)",
              "cases": cases}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(out, cases)
    print(f"wrote {out}/result.json and plot.png", file=sys.stderr)


def plot(out: Path, cases: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for form in ("onednn", "amx"):
        pts = [(c["rows"], c["ms_per_pass"]) for c in cases if c["form"] == form]
        ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o",
                label={"onednn": "oneDNN (PackedLinear)", "amx": "AMX tiles (AmxLinear)"}[form])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("ms per pass (30 layers + head)")
    ax.set_title("bfloat16 linears, default model's shapes, weights in memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)


if __name__ == "__main__":
    main()
