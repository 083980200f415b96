"""Medians of an A/B run of benchmarks/cpu/run_core_ab.sh -> summary.json + summary.png."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

METRICS = {  # file prefix -> (label, how to read the figure, higher is better)
    "offline-single": ("offline single stream, decode tok/s",
                       lambda d: d[0]["decode_tok_s"]),
    "offline-batch64": ("offline 64 x 128, output tok/s", lambda d: d[0]["output_tok_s"]),
    "serve-single": ("served single stream, 1/TPOT p50 (tok/s)",
                     lambda d: 1000.0 / d["tpot_ms"]["p50"]),
    "serve-batch": ("served 32 concurrent, output tok/s", lambda d: d["output_tok_s"]),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--before", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--after", default=None, help="B's commit when B ran from a checkout of it "
                   "(else this working tree's HEAD, marked +dirty where it has edits)")
    p.add_argument("--what", default="engine on a thread of the HTTP process|"
                   "step contract (deltas) + engine core process",
                   help="what A and B are, 'A|B'")
    args = p.parse_args()
    out = Path(args.dir)
    rows, machine = {}, None
    for prefix, (label, read) in METRICS.items():
        row = {"label": label}
        for sys in ("A", "B"):
            values = []
            for f in sorted(out.glob(f"{prefix}-{sys}-*.json")):
                data = json.loads(f.read_text())
                machine = machine or (data[0] if isinstance(data, list) else data)["machine"]
                values.append(round(read(data), 2))
            row[sys] = {"runs": values, "median": statistics.median(values) if values else None}
        a, b = row["A"]["median"], row["B"]["median"]
        row["b_over_a"] = round(b / a, 4) if a and b else None
        rows[prefix] = row
    what_a, what_b = args.what.split("|", 1)
    summary = {"kind": "core-ab", "command": args.command, "machine": machine,
               "A": {"commit": args.before, "what": what_a},
               "B": {"commit": args.after or _head(), "what": what_b},
               "metrics": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(rows, out / "summary.png", machine)
    for r in rows.values():
        print(f"{r['label']:45s} A {r['A']['runs']} B {r['B']['runs']}  B/A {r['b_over_a']}")


def _head() -> str:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return commit + ("+dirty" if dirty else "")


def _plot(rows: dict, path: Path, machine: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.6))
    for ax, row in zip(axes, rows.values()):
        for i, sys in enumerate(("A", "B")):
            runs = row[sys]["runs"]
            ax.bar(i, row[sys]["median"] or 0, color=("#999999", "#3366cc")[i], width=0.6)
            ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        ax.set_xticks([0, 1], ["A: before", "B: after"])
        ax.set_title(row["label"], fontsize=9)
        ax.set_ylim(bottom=0)
    cpu = (machine or {}).get("cpu", "?")
    fig.suptitle(f"A/B (medians, dots = runs), {cpu}, 2 threads",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
