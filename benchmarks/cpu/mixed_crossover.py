"""Micro-benchmark: where the GGUF codes stop paying and bfloat16 GEMMs start (gguf-mixed).

One pass = the default model's 30 layers of linears (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536), each layer with its own weights so that a pass reads them from
DRAM as a decode step does (106M weights: 212 MB in bfloat16, ~80 MB as int4 codes with
float32 scales). Two forms of the same weights: Int4Linear (servelm's int4 kernel, float32
activations: what `gguf` and gguf-mixed's few-row form run) and PackedLinear in bfloat16
(oneDNN: what the default and gguf-mixed's many-row form run), at 1, 2, 4, 8, 16 and 32 rows
of bfloat16 activations; the two forms interleaved in each round, median of the rounds.
servelm/quant/mixed_linear.py's MAX_ROWS is read off this curve.

    .venv/bin/python benchmarks/cpu/mixed_crossover.py [--threads 2] [--rounds 5]

Writes result.json (command, machine, commit) and plot.png under
benchmarks/results/mixed-crossover-<UTC ts>/.
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
from servelm.layers.linear import PackedLinear
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.mixed_linear import MAX_ROWS

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32)


def _layers(seed: int):
    g = torch.Generator().manual_seed(seed)
    int4, bf16 = [], []
    for _ in range(LAYERS):
        a, b = [], []
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
            layer = Int4Linear(q, scale, -8 * scale, 32, None, torch.bfloat16, kernel="cpu")
            a.append(layer)
            b.append(PackedLinear(layer.dequantize().bfloat16(), None))
        int4.append(a)
        bf16.append(b)
    return int4, bf16


def _pass_ms(layers, rows: int) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
    start = time.perf_counter()
    for layer in layers:
        for lin, (_, k) in zip(layer, SHAPES):
            lin(xs[k])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    int4, bf16 = _layers(0)
    cases = []
    with torch.inference_mode():
        for rows in ROWS:
            _pass_ms(int4, rows), _pass_ms(bf16, rows)  # warm: oneDNN primitives, pages
            t4, t16 = [], []
            for _ in range(a.rounds):
                t4.append(_pass_ms(int4, rows))
                t16.append(_pass_ms(bf16, rows))
            case = {"rows": rows, "int4_ms": statistics.median(t4),
                    "bf16_ms": statistics.median(t16)}
            case["int4_over_bf16"] = case["int4_ms"] / case["bf16_ms"]
            cases.append(case)
            print(f"{rows:>3} rows: int4 codes {case['int4_ms']:7.2f} ms   bf16 "
                  f"{case['bf16_ms']:7.2f} ms   ratio {case['int4_over_bf16']:.2f}",
                  file=sys.stderr)
    ts = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(a.out or f"benchmarks/results/mixed-crossover-{ts}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"kind": "mixed_crossover", "command": " ".join(["python", *sys.argv]),
              "machine": machine_info(a.threads), "commit": git_commit(),
              "threads": a.threads, "rounds": a.rounds, "layers": LAYERS,
              "shapes": [list(s) for s in SHAPES], "max_rows": MAX_ROWS, "cases": cases}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ROWS, [c["int4_ms"] for c in cases], "o-", label="int4 codes (gguf)")
    ax.plot(ROWS, [c["bf16_ms"] for c in cases], "s-", label="bfloat16 (oneDNN)")
    ax.axvline(MAX_ROWS, color="grey", ls=":", label=f"gguf-mixed switches above {MAX_ROWS}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("ms per pass (30 layers' linears)")
    ax.set_title(f"{result['machine'].get('cpu', 'CPU')}, {a.threads} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    print(f"wrote {out}/result.json and plot.png", file=sys.stderr)


if __name__ == "__main__":
    main()
