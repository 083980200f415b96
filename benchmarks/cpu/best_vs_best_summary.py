"""Summary of a benchmarks/cpu/run_best_vs_best.sh run -> summary.json, summary.md, summary.png.

Owns: reading the run's per-system `bench offline` results (batch-*.json, single-*.json;
with ROUNDS=N, one file a system and round: batch-*.r<N>.json), the table of every system on
both workloads (each system's median round), and the ratios the bar is stated in: servelm's
default against each peer's best configuration on this CPU, and round by round.
Never: runs a system (the shell script does, one at a time), or reads a figure from anywhere
but the run's own folder.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from servelm.bench.results import cpu_flags

SERVELM_CONFIGS = ["default", "float32", "float32-onednn", "bfloat16", "gguf", "gguf-a8",
                   "gguf-mixed", "gguf-mixed-a8"]
PEERS = ["vllm", "vllm-bf16", "llama-server", "llama.cpp"]
LABELS = {"default": "servelm default", "float32": "servelm float32",
          "float32-onednn": "servelm float32, oneDNN alone (--cpu-kernels gemm=torch)",
          "bfloat16": "servelm bfloat16", "gguf": "servelm gguf",
          "gguf-a8": "servelm gguf, int8 activations",
          "gguf-mixed": "servelm gguf-mixed (codes <= 4 rows, model dtype above)",
          "gguf-mixed-a8": "servelm gguf-mixed, int8 activations",
          "vllm": "vLLM-CPU fp32",
          "vllm-bf16": "vLLM-CPU bf16", "llama-server": "llama-server (parallel slots)",
          "llama.cpp": "llama.cpp (one request after another)"}
WORKLOADS = ("batch", "single")
# (workload, servelm side, peers, bar): the bars as docs/benchmarks.md states them.
BARS = [("batch", ["default"], ["vllm", "vllm-bf16"], 1.5, "output_tok_s"),
        ("batch", ["default"], ["llama-server", "llama.cpp"], 3.0, "output_tok_s"),
        ("single", SERVELM_CONFIGS, ["llama-server", "llama.cpp"], 1.5, "decode_tok_s")]


METRIC = {"batch": "output_tok_s", "single": "decode_tok_s"}  # what a round is ranked by
ROUND = re.compile(r"\.r(\d+)$")  # ROUNDS=N runs: <workload>-<system>.r<round>.json


def load_rounds(folder: Path) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """{workload: {system key: {round: result}}} (round 1 for a run of one round); a system
    that failed keeps its error."""
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {w: {} for w in WORKLOADS}

    def files(stem: str):
        for path in sorted(folder.glob(f"{stem}*.json")):
            rest = path.name[len(stem):-len(".json")]
            match = ROUND.fullmatch(rest)
            if rest == "" or match:
                yield (int(match.group(1)) if match else 1), path

    for workload in WORKLOADS:
        for name in SERVELM_CONFIGS:
            for rnd, path in files(f"{workload}-servelm-{name}"):
                runs[workload].setdefault(name, {})[rnd] = json.loads(path.read_text())[0]
        for rnd, path in files(f"{workload}-peers"):
            for result in json.loads(path.read_text()):
                runs[workload].setdefault(result["system"], {})[rnd] = result
    return runs


def median_result(rounds: dict[int, dict[str, Any]], metric: str) -> dict[str, Any]:
    """The round whose `metric` is the median of the rounds that ran (the lower middle one
    of an even count); the first round's error where none ran."""
    ran = sorted((r for r in rounds.values() if r.get(metric)), key=lambda r: r[metric])
    return ran[(len(ran) - 1) // 2] if ran else rounds[min(rounds)]


def medians(rounds: dict) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {system key: result}}: each system's median round (load_rounds' form in)."""
    return {w: {key: median_result(rs, METRIC[w]) for key, rs in systems.items()}
            for w, systems in rounds.items()}


def label(key: str, runs: dict) -> str:
    """A servelm row names the float type its model computed in (what the default chose); a
    peer's row does so only where its engine ran another type than the one asked for."""
    settings = [r.get("settings") or {} for w in WORKLOADS for k, r in runs[w].items()
                if k == key]
    ran = {s.get("model_dtype") for s in settings} - {None, "None"}
    if key not in SERVELM_CONFIGS:
        asked = {s.get("dtype") for s in settings} - {None}
        return LABELS[key] + (f" (ran {', '.join(sorted(ran))})" if ran - asked else "")
    return LABELS[key] + (f" ({', '.join(sorted(ran))})" if ran else "")


def round_ratios(rounds: dict, entry: dict) -> list[dict[str, Any]]:
    """An entry's two systems round by round (the rounds both ran), in order."""
    workload, key = entry["workload"], entry["metric"]
    mine = rounds[workload].get(entry["servelm"], {})
    theirs = rounds[workload].get(entry["peer"], {})
    out = []
    for rnd in sorted(set(mine) & set(theirs)):
        a, b = mine[rnd].get(key), theirs[rnd].get(key)
        if a and b:
            out.append({"round": rnd, "servelm_value": round(a, 2), "peer_value": round(b, 2),
                        "ratio": round(a / b, 3)})
    return out


def ratio_entries(runs: dict, rounds: dict | None = None) -> list[dict[str, Any]]:
    """The bars on each system's median round; with `rounds`, each bar's pair round by
    round too (`rounds` in the entry, where there was more than one)."""
    entries = []
    for workload, ours, theirs, bar, key in BARS:
        have = runs[workload]
        mine = {n: have[n].get(key) for n in ours if n in have and have[n].get(key)}
        peers = {n: have[n].get(key) for n in theirs if n in have and have[n].get(key)}
        if not mine or not peers:
            missing = [n for n in (ours if not mine else []) + (theirs if not peers else [])]
            entries.append({"workload": workload, "metric": key, "bar": bar, "ratio": None,
                            "missing": missing})
            continue
        best_mine = max(mine, key=mine.get)
        best_peer = max(peers, key=peers.get)
        ratio = mine[best_mine] / peers[best_peer]
        entries.append({"workload": workload, "metric": key, "servelm": best_mine,
                        "servelm_value": round(mine[best_mine], 2), "peer": best_peer,
                        "peer_value": round(peers[best_peer], 2), "ratio": round(ratio, 3),
                        "bar": bar, "met": ratio >= bar})
        by_round = round_ratios(rounds, entries[-1]) if rounds else []
        if len(by_round) > 1:
            entries[-1]["rounds"] = by_round
    return entries


def _fmt(value, spec="{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def table_rows(runs: dict) -> list[dict[str, Any]]:
    rows = []
    for key in SERVELM_CONFIGS + PEERS:
        batch, single = runs["batch"].get(key), runs["single"].get(key)
        if batch is None and single is None:
            continue
        row = {"system": label(key, runs), "key": key}
        for name, result in (("batch", batch), ("single", single)):
            result = result or {}
            row[name] = {"error": result.get("error"), "output_tok_s": result.get("output_tok_s"),
                         "decode_tok_s": result.get("decode_tok_s"),
                         "ttft_mean_ms": None if not (result.get("ttft_s") or {}).get("mean")
                         else result["ttft_s"]["mean"] * 1e3,
                         "elapsed_s": result.get("elapsed_s"),
                         "peak_mib": None if result.get("peak_memory_bytes") is None
                         else result["peak_memory_bytes"] / 2**20,
                         "settings": result.get("settings")}
        rows.append(row)
    return rows


def shape(workload: dict | None) -> str:
    if not workload:
        return "?"
    return (f"{workload['num_prompts']} x ({workload['input_len']} + "
            f"{workload['output_len']})")


def render_markdown(rows: list[dict], ratios: list[dict], machine: dict,
                    workloads: dict, rounds: int = 1) -> str:
    lines = [f"CPU: {machine.get('cpu')}, {machine.get('threads')} threads; flags: "
             f"{' '.join(machine.get('cpu_flags', []))}", "",
             f"| system | {shape(workloads['batch'])}: output tok/s | TTFT mean ms | peak MiB "
             f"| {shape(workloads['single'])}: decode tok/s | TTFT ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        b, s = r["batch"], r["single"]
        cells = [_fmt(b["output_tok_s"]), _fmt(b["ttft_mean_ms"], "{:.0f}"),
                 _fmt(b["peak_mib"], "{:.0f}"), _fmt(s["decode_tok_s"]),
                 _fmt(s["ttft_mean_ms"], "{:.0f}")]
        if b["error"]:
            cells[0] = "FAILED"
        if s["error"]:
            cells[3] = "FAILED"
        lines.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    lines.append("")
    for e in ratios:
        if e["ratio"] is None:
            lines.append(f"- {e['workload']} {e['metric']}: not measured ({e['missing']})")
            continue
        lines.append(f"- {e['workload']} {e['metric']}: {LABELS[e['servelm']]} "
                     f"{e['servelm_value']} / {LABELS[e['peer']]} {e['peer_value']} = "
                     f"**{e['ratio']:.2f}x** (bar {e['bar']}x: "
                     f"{'met' if e['met'] else 'not met'})")
        if e.get("rounds"):
            lines.append("  - round by round: " + ", ".join(
                f"{r['servelm_value']:.1f} / {r['peer_value']:.1f} = {r['ratio']:.2f}x"
                for r in e["rounds"]))
    if rounds > 1:
        lines.insert(2, f"Each figure: the median of {rounds} rounds, the systems run in turn "
                        "in each round.\n")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str, workloads: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    panels = [("batch", "output_tok_s", f"{shape(workloads['batch'])}: output tok/s"),
              ("single", "decode_tok_s", f"{shape(workloads['single'])}: decode tok/s")]
    for ax, (workload, key, label) in zip(axes, panels):
        have = [r for r in rows if r[workload][key]]
        names = [r["system"].replace(" (", "\n(") for r in have]
        values = [r[workload][key] for r in have]
        colors = ["#d62728" if r["key"] in SERVELM_CONFIGS else "#1f77b4" for r in have]
        bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
        for bar, value in zip(bars, values[::-1]):
            ax.annotate(f"{value:.1f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        va="center", fontsize=8, xytext=(3, 0), textcoords="offset points")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.15)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def git_commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--command", required=True, help="the command that made the run")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    rounds = load_rounds(folder)
    runs = medians(rounds)
    num_rounds = max((len(rs) for systems in rounds.values() for rs in systems.values()),
                     default=1)
    found = [r for w in runs.values() for r in w.values()]
    if not found:
        print(f"error: folder: no results in {folder}", file=sys.stderr)
        return 2
    machine = dict(next((r["machine"] for r in found if r.get("machine")), {}))
    machine["cpu_flags"] = cpu_flags()
    rows, ratios = table_rows(runs), ratio_entries(runs, rounds)
    summary = {"kind": "best-vs-best", "command": args.command, "machine": machine,
               "commits": sorted({r["commit"] for r in found if r.get("commit")}),
               "summary_commit": git_commit(),
               "workloads": {w: next((r.get("workload") for r in runs[w].values()
                                      if r.get("workload")), None) for w in WORKLOADS},
               "rounds": num_rounds, "systems": rows, "ratios": ratios}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = render_markdown(rows, ratios, machine, summary["workloads"], num_rounds)
    (folder / "summary.md").write_text(markdown)
    has = lambda flag: "yes" if flag in machine["cpu_flags"] else "no"
    plot(rows, folder / "summary.png",
         f"{machine.get('cpu')}, {machine.get('threads')} threads (avx512_bf16: "
         f"{has('avx512_bf16')}, amx_bf16: {has('amx_bf16')}, amx_int8: {has('amx_int8')}); "
         f"commit {', '.join(summary['commits']) or '?'}", summary["workloads"])
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
