"""Micro-benchmark: what one linear layer sustains on this CPU, float32 against int8 math.

The default model's four layer shapes (out x in: qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536) at M = 1, 4, 16, 64, 256 rows, through three paths: float32
weights packed once for oneDNN (PackedLinear, the default's linears), float32 weights in
servelm's own panels (DetLinear: servelm_cpu::det_linear, deterministic mode's
batch-invariant kernel) and the GGUF's 4-bit codes with int8 activations
(servelm_cpu::int4_gemm_a8, `--quantization gguf --quant-activations int8`; the activation
rounding is inside the call). Random weights;
each case is timed interleaved A/B, median of the rounds. Rates count 2 M N K operations
(multiply and add). Writes result.json (command, machine, commit) and plot.png under
benchmarks/results/linear-rates-<UTC ts>/.

    .venv/bin/python benchmarks/cpu/linear_rates_micro.py [--threads 2] [--rounds 7]
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
from servelm.layers.det_linear import DetLinear
from servelm.layers.linear import PackedLinear
from servelm.quant.cpu_panels import pack_int4_vnni

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 4, 16, 64, 256)


def _ms(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ops = cpu_kernels.ops_for_mode("quant", "kernel")
    gen = torch.Generator().manual_seed(0)
    cases = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            dense, panels = PackedLinear(w, None), DetLinear(w, None)
            codes = pack_int4_vnni(torch.randint(0, 16, (n, k), generator=gen))
            so = (torch.rand(codes.shape[0], k // 32, 2, 16, generator=gen) * 0.01).half()
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                f32 = lambda: dense(x)  # noqa: E731
                det = lambda: panels(x)  # noqa: E731
                a8 = lambda: ops.int4_gemm_a8(x, codes, so, n, 32)  # noqa: E731
                iters = max(3, int(2e8 // (2 * m * n * k)))
                f32(), det(), a8()
                t32, tdet, t8 = [], [], []
                for _ in range(a.rounds):
                    t32.append(_ms(f32, iters))
                    tdet.append(_ms(det, iters))
                    t8.append(_ms(a8, iters))
                ops_count = 2 * m * n * k
                case = {"shape": name, "n": n, "k": k, "rows": m,
                        "float32_ms": statistics.median(t32),
                        "float32_panels_ms": statistics.median(tdet),
                        "int4_a8_ms": statistics.median(t8)}
                case["float32_gflop_s"] = ops_count / case["float32_ms"] / 1e6
                case["float32_panels_gflop_s"] = ops_count / case["float32_panels_ms"] / 1e6
                case["int4_a8_gop_s"] = ops_count / case["int4_a8_ms"] / 1e6
                cases.append(case)
                print(f"{name:8s} M={m:3d}: float32 {case['float32_gflop_s']:6.1f} GFLOP/s, "
                      f"panels {case['float32_panels_gflop_s']:6.1f} GFLOP/s, "
                      f"int4 x int8 {case['int4_a8_gop_s']:6.1f} GOP/s", file=sys.stderr)
    ts = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(a.out or f"benchmarks/results/linear-rates-{ts}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"kind": "linear_rates_micro", "command": " ".join(["python", *sys.argv]),
              "machine": machine_info(a.threads), "commit": git_commit(),
              "threads": a.threads, "rounds": a.rounds, "cases": cases}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "float32_gflop_s", "float32 (oneDNN, packed)"),
                           (axes[1], "float32_panels_gflop_s", "float32 (servelm panels)"),
                           (axes[2], "int4_a8_gop_s", "int4 codes x int8 activations")):
        for name in SHAPES:
            rows = [c for c in cases if c["shape"] == name]
            ax.plot([c["rows"] for c in rows], [c[key] for c in rows], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (M)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("G multiply-add ops x 2 / s")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{result['machine'].get('cpu', 'CPU')}, {a.threads} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    print(f"wrote {out}/result.json and plot.png", file=sys.stderr)


if __name__ == "__main__":
    main()
