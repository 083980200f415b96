"""Micro-benchmark: servelm's avx512_bf16 GEMM (DotLinear, servelm_cpu::dot_linear) against
oneDNN's packed bfloat16 GEMM (PackedLinear), the two forms a bfloat16 model's linears take.

The default model's four layer shapes (out x in: qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536) and its head (49152 x 576) at M = 1 .. 2048 rows, the weights
hot in cache (the same layer called over and over), timed interleaved A/B, median of the
rounds; then a decode step's linears as the engine meets them: 30 layers of distinct weights
(read from memory) at 64 rows, gate_up with and without silu_and_mul fused into the GEMM.
Rates count 2 M N K operations (a multiply and an add). Random weights. Writes result.json
(command, machine, commit) and plot.png under --out (default
benchmarks/results/dot-linear-micro-<UTC ts>/).

    .venv/bin/python benchmarks/cpu/dot_linear_micro.py [--threads 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from servelm import cpu_kernels
from servelm.bench.results import git_commit, machine_info
from servelm.layers.dot_linear import DotLinear, dot_usable
from servelm.layers.linear import PackedLinear

sys.path.insert(0, str(Path(__file__).parent))
from linear_rates_micro import _ms  # noqa: E402 - its timing loop

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
ROWS = (1, 8, 16, 32, 64, 128, 256, 512, 2048)
LAYERS = 30


def _ab(a, b, rounds: int, budget_ms: float = 60.0) -> tuple[float, float]:
    """Median ms per call of a and b, interleaved: each round times both."""
    a(), b()
    iters = max(1, int(budget_ms / max(1e-3, _ms(a, 1))))
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_ms(a, iters))
        tb.append(_ms(b, iters))
    return statistics.median(ta), statistics.median(tb)


def hot_rates(rounds: int) -> list[dict]:
    cases = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        onednn, dot = PackedLinear(w, None), DotLinear(w, None)
        for m in ROWS:
            if name == "head" and m > 64:  # the head sees a step's last rows only
                continue
            x = torch.randn(m, k, generator=gen).bfloat16()
            ms_onednn, ms_dot = _ab(lambda: onednn(x), lambda: dot(x), rounds)
            flop = 2 * m * n * k
            cases.append({"shape": name, "n": n, "k": k, "rows": m, "onednn_ms": ms_onednn,
                          "dot_ms": ms_dot, "onednn_gflop_s": flop / ms_onednn / 1e6,
                          "dot_gflop_s": flop / ms_dot / 1e6, "speedup": ms_onednn / ms_dot})
            print(f"{name:8s} M={m:5d}: oneDNN {flop / ms_onednn / 1e6:6.0f}  dot "
                  f"{flop / ms_dot / 1e6:6.0f} GFLOP/s  ({ms_onednn / ms_dot:.2f}x)",
                  file=sys.stderr)
    return cases


def decode_pass(rounds: int) -> dict:
    """30 layers of distinct weights at 64 rows: oneDNN, the dots, the dots with gate_up's
    silu_and_mul fused (as the engine runs a bfloat16 decode step's linears)."""
    from servelm.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(LAYERS):
        ws = {s: (torch.randn(*SHAPES[s], generator=gen) * 0.02).bfloat16()
              for s in ("qkv", "o", "gate_up", "down")}
        layers.append(({s: PackedLinear(w, None) for s, w in ws.items()},
                       {s: DotLinear(w, None) for s, w in ws.items()}))
    x = torch.randn(64, 576, generator=gen).bfloat16()
    xi = torch.randn(64, 1536, generator=gen).bfloat16()

    def run(form: int, fused: bool):
        for pair in layers:
            lin = pair[form]
            lin["qkv"](x), lin["o"](x)
            lin["gate_up"].silu_and_mul(x) if fused else silu_and_mul(lin["gate_up"](x))
            lin["down"](xi)

    out = {}
    for label, form, fused in (("onednn", 0, False), ("dot", 1, False), ("dot_fused", 1, True)):
        run(form, fused)
        out[label + "_ms"] = statistics.median(_ms(lambda: run(form, fused), 3)
                                               for _ in range(rounds))
        print(f"decode pass, 30 layers at 64 rows, {label}: {out[label + '_ms']:.2f} ms",
              file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not dot_usable():
        sys.exit("dot_linear_micro: avx512_bf16 does not run on this CPU (no DotLinear here)")
    cpu_kernels.load()
    torch.set_num_threads(a.threads)
    ts = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(a.out or f"benchmarks/results/dot-linear-micro-{ts}")
    result = {"kind": "dot_linear_micro", "command": " ".join(["python", *sys.argv]),
              "machine": machine_info(a.threads), "commit": git_commit(),
              "threads": a.threads, "rounds": a.rounds, "hot": hot_rates(a.rounds),
              "decode_pass_64_rows": decode_pass(a.rounds)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "plot.png")
    print(f"wrote {out}/result.json and plot.png", file=sys.stderr)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    for i, name in enumerate(SHAPES):
        rows = [c for c in result["hot"] if c["shape"] == name]
        color = f"C{i}"
        ax.plot([c["rows"] for c in rows], [c["dot_gflop_s"] for c in rows], "-o", color=color,
                label=f"{name} dot")
        ax.plot([c["rows"] for c in rows], [c["onednn_gflop_s"] for c in rows], "--x",
                color=color, alpha=0.6, label=f"{name} oneDNN")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("GFLOP/s (weights in cache)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"bfloat16 linears, {result['machine'].get('cpu', 'CPU')}, "
                 f"{result['threads']} threads", fontsize=9)
    d = result["decode_pass_64_rows"]
    labels = ["oneDNN", "dot", "dot + fused silu"]
    vals = [d["onednn_ms"], d["dot_ms"], d["dot_fused_ms"]]
    bars = bx.bar(labels, vals, color=["C7", "C0", "C2"])
    bx.bar_label(bars, fmt="%.1f", fontsize=8)
    bx.set_ylabel("ms (30 layers, 64 rows, weights from memory)")
    bx.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
