"""`servelm bench compare`: several systems' `bench serve` results side by side.

Owns: reading `bench serve` result files (rate sweeps, and document batches run all at once
or one after another), grouping them by system (the `--label` given to `bench serve`), the
combined table, JSON and PNG: every system's curves on shared axes, and the document batch.
Never: sends requests or starts servers (benchmarks/cpu/run_serve.sh runs one system at a
time and then calls this).

    servelm bench compare serve-sweep-servelm.json serve-sweep-vllm.json \\
        serve-documents-batch-servelm.json serve-documents-sequential-servelm.json ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from servelm.bench.results import SCHEMA_VERSION, git_commit, machine_info

DEFAULT_RESULTS_DIR = Path("benchmarks/results")
# The fields of the workload that must agree for two systems' numbers to be comparable.
WORKLOAD_KEYS = ("kind", "num_prompts", "input_len", "output_len", "seed", "prompt_format",
                 "endpoint")
# servelm first and in red, as in `bench offline`'s plot; the peers in a fixed order after.
COLORS = {"servelm": "#d62728", "vllm": "#1f77b4", "llama.cpp": "#2ca02c"}
OTHER_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


class CompareError(ValueError):
    """A result file that cannot be compared; the message names the file."""


def load_result(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except OSError as e:
        raise CompareError(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise CompareError(f"{path}: not JSON: {e}") from None
    if not isinstance(result, dict) or result.get("kind") not in ("serve", "serve_sweep"):
        raise CompareError(f"{path}: not a `servelm bench serve` result (kind "
                           f"{result.get('kind') if isinstance(result, dict) else None!r})")
    return result


def system_of(result: dict[str, Any]) -> str:
    """The `--label` it was run with; else what the server called its model; else the URL."""
    if result.get("system"):
        return str(result["system"])
    models = (result.get("server") or {}).get("models") or \
        ((result.get("runs") or [{}])[0].get("server") or {}).get("models")
    if models:
        return str(models[0])
    return str(result.get("base_url", "?"))


def documents_mode(result: dict[str, Any], path: str) -> str:
    """'batch' (every document sent at once) or 'sequential' (one after another)."""
    load = result.get("load") or {}
    if load.get("request_rate") == "inf":
        return "batch"
    if load.get("concurrency") == 1:
        return "sequential"
    raise CompareError(f"{path}: a documents run must be sent all at once (--request-rate "
                       f"inf) or one after another (--concurrency 1), got {load}")


def _documents_entry(result: dict[str, Any], path: str) -> dict[str, Any]:
    keys = ("num_requests", "num_completed", "num_failed", "failures", "elapsed_s",
            "num_input_tokens", "num_output_tokens", "num_without_usage", "output_tok_s",
            "total_tok_s")
    return {**{k: result.get(k) for k in keys}, "ttft_p50_ms": result["ttft_ms"]["p50"],
            "e2e_max_ms": result["e2e_ms"]["max"], "source": str(path)}


def _sweep_entry(result: dict[str, Any], path: str) -> dict[str, Any]:
    summary = result["summary"]
    points = summary["points"]
    knee = summary.get("knee")
    return {"source": str(path), "summary": summary,
            "max_rate_meeting_target": summary["max_rate_meeting_target"],
            "first_rate_below_target": summary["first_rate_below_target"],
            "knee_rate": knee["request_rate"] if knee else None,
            "peak_output_tok_s": max((p["output_tok_s"] for p in points), default=None),
            "num_failed": sum(r.get("num_failed", 0) for r in result.get("runs", [])),
            "warnings": [r["warning"] for r in result.get("runs", []) if r.get("warning")]}


def _slo_of(result: dict[str, Any]) -> dict[str, Any] | None:
    run = (result.get("runs") or [result])[0]
    return run.get("slo")


def compare(results: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Group (path, result) pairs by system: each system's sweep (at most one) and its
    document batch all at once and one after another, with their ratio. Warnings (not
    errors) when the systems did not run the same workload, rates or SLOs."""
    systems: dict[str, dict[str, Any]] = {}
    workloads: dict[str, dict[str, Any]] = {}  # per group: the first system's workload
    slos, rates, warnings = {}, {}, []
    for path, result in results:
        name = system_of(result)
        entry = systems.setdefault(name, {"system": name, "sweep": None, "documents": {}})
        info = result.get("workload") or {}
        if result["kind"] == "serve_sweep":
            if entry["sweep"] is not None:
                raise CompareError(f"{path}: a second sweep for {name!r} (give each system "
                                   f"one sweep; label runs with `bench serve --label`)")
            entry["sweep"] = _sweep_entry(result, path)
            group = "sweep"
            rates[name] = result["summary"]["rates"]
            slos[name] = _slo_of(result)
        elif info.get("kind") == "documents":
            mode = documents_mode(result, path)
            if mode in entry["documents"]:
                raise CompareError(f"{path}: a second documents {mode} run for {name!r}")
            entry["documents"][mode] = _documents_entry(result, path)
            group = "documents"
        else:
            raise CompareError(f"{path}: a single run of the {info.get('kind')!r} workload; "
                               f"compare takes rate sweeps and documents runs")
        shape = {k: info.get(k) for k in WORKLOAD_KEYS}
        first = workloads.setdefault(group, {"system": name, **shape})
        if any(first[k] != shape[k] for k in WORKLOAD_KEYS):
            warnings.append(f"{path}: {group} workload {shape} differs from "
                            f"{first['system']}'s {({k: first[k] for k in WORKLOAD_KEYS})}")
    for what, per_system in (("rates", rates), ("SLOs", slos)):
        if len({json.dumps(v, sort_keys=True) for v in per_system.values()}) > 1:
            warnings.append(f"the sweeps used different {what}: {per_system}")
    for entry in systems.values():
        docs = entry["documents"]
        batch, seq = docs.get("batch"), docs.get("sequential")
        # sequential / batch: how many times faster the batch is (> 1: batching pays).
        docs["speedup"] = (seq["elapsed_s"] / batch["elapsed_s"]
                           if batch and seq and not batch["num_failed"]
                           and not seq["num_failed"] else None)
    slo = next(iter(slos.values()), None)
    target = next((e["sweep"]["summary"]["goodput_target"] for e in systems.values()
                   if e["sweep"]), None)
    return {"systems": list(systems.values()), "slo": slo, "goodput_target": target,
            "workloads": workloads, "warnings": warnings}


# --- output ------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def render_compare_table(comparison: dict[str, Any]) -> str:
    from servelm.bench.sweep import render_sweep_table

    target = comparison.get("goodput_target") or 0.9
    slo = comparison.get("slo") or {}
    out = []
    for e in comparison["systems"]:
        if e["sweep"]:
            out += [f"== {e['system']}: rate sweep", render_sweep_table(e["sweep"]["summary"]),
                    ""]
    head = (f"{'system':<12} {f'max rate, goodput>={target:.0%}':>24} {'knee':>8} "
            f"{'peak out tok/s':>15} {'docs at once':>13} {'one by one':>11} {'ratio':>7}")
    out += [f"SLOs: TTFT {_fmt(slo.get('ttft_ms'), 'g', ' ms')}, "
            f"TPOT {_fmt(slo.get('tpot_ms'), 'g', ' ms')}", head, "-" * len(head)]
    for e in comparison["systems"]:
        s, d = e["sweep"] or {}, e["documents"]

        def secs(mode):
            run = d.get(mode)
            if not run:
                return "-"
            failed = f" ({run['num_failed']} failed)" if run["num_failed"] else ""
            return f"{run['elapsed_s']:.1f} s{failed}"

        best = s.get("max_rate_meeting_target")
        best_text = "-" if not s else "none" if best is None else f"{best:g} req/s"
        out.append(f"{e['system']:<12} {best_text:>24} "
                   f"{_fmt(s.get('knee_rate'), 'g', '/s'):>8} "
                   f"{_fmt(s.get('peak_output_tok_s'), '.1f'):>15} {secs('batch'):>13} "
                   f"{secs('sequential'):>11} {_fmt(d.get('speedup'), '.2f', 'x'):>7}")
    out += [f"warning: {w}" for w in comparison["warnings"]]
    for e in comparison["systems"]:
        out += [f"warning: {e['system']}: {w}" for w in (e["sweep"] or {}).get("warnings", [])]
    return "\n".join(out)


def _color(name: str, i: int) -> str:
    return COLORS.get(name, OTHER_COLORS[i % len(OTHER_COLORS)])


def plot_compare(comparison: dict[str, Any], path: Path, title: str) -> Path | None:
    """Four panels: p50 (solid) and p99 (dashed) TTFT, then TPOT, against output tok/s, one
    colour per system, with the SLO lines; goodput against request rate with the target and
    each system's highest rate meeting it; the document batch, all at once vs one by one."""
    systems = comparison["systems"]
    if not any(e["sweep"] and e["sweep"]["summary"]["points"] or e["documents"].get("batch")
               for e in systems):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = comparison.get("slo") or {}
    fig, axes = plt.subplots(1, 4, figsize=(21, 5.2))
    for i, e in enumerate(systems):
        points = e["sweep"]["summary"]["points"] if e["sweep"] else []
        if not points:
            continue
        color = _color(e["system"], i)
        x = [p["output_tok_s"] for p in points]
        for ax, name in ((axes[0], "ttft"), (axes[1], "tpot")):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [p[f"{name}_{q}_ms"] for p in points]
                ax.plot(x, [math.nan if y is None else y for y in ys], style, color=color,
                        label=f"{e['system']} {q}", alpha=1.0 if q == "p50" else 0.6)
            for p in points:
                ax.annotate(f"{p['request_rate']:g}/s", (p["output_tok_s"],
                            p[f"{name}_p50_ms"] or 0), textcoords="offset points",
                            xytext=(3, -9), fontsize=6, color=color)
        rates = [p["request_rate"] for p in points]
        # Goodputs often coincide (1.0 at light load): later systems draw thinner lines and
        # smaller markers on top, so every system stays visible.
        axes[2].plot(rates, [p["goodput"] for p in points], "o-", color=color,
                     label=e["system"], lw=max(3.5 - 1.0 * i, 1.0), ms=max(10 - 2.5 * i, 4))
        best = e["sweep"]["max_rate_meeting_target"]
        if best is not None:
            axes[2].axvline(best, color=color, lw=1, ls="--", alpha=0.6)
    for ax, name in ((axes[0], "ttft"), (axes[1], "tpot")):
        limit = slo.get(f"{name}_ms")
        if limit is not None:
            ax.axhline(limit, color="black", lw=1, ls=":", label=f"SLO {limit:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("output tok/s (each point one request rate)")
        ax.set_ylabel(f"{name.upper()} (ms), log scale")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    target = comparison.get("goodput_target")
    if target is not None:
        axes[2].axhline(target, color="black", lw=1, ls=":", label=f"target {target:.0%}")
    axes[2].set_xlabel("request rate (req/s); dashed: highest rate meeting the target")
    axes[2].set_ylabel("goodput (share meeting both SLOs)")
    axes[2].set_ylim(-0.02, 1.05)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    _plot_documents(axes[3], systems)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_documents(ax, systems: list[dict[str, Any]]) -> None:
    with_docs = [(i, e) for i, e in enumerate(systems) if e["documents"].get("batch")
                 or e["documents"].get("sequential")]
    if not with_docs:
        ax.axis("off")
        ax.text(0.5, 0.5, "no document-batch runs", ha="center", va="center")
        return
    width = 0.38
    for j, (i, e) in enumerate(with_docs):
        d = e["documents"]
        for k, (mode, hatch) in enumerate((("batch", None), ("sequential", "//"))):
            run = d.get(mode)
            if not run:
                continue
            x = j + (k - 0.5) * width
            ax.bar(x, run["elapsed_s"], width, color=_color(e["system"], i), hatch=hatch,
                   edgecolor="white", alpha=1.0 if mode == "batch" else 0.55)
            ax.annotate(f"{run['elapsed_s']:.0f} s", (x, run["elapsed_s"]), ha="center",
                        va="bottom", fontsize=8)
        if d.get("speedup"):
            top = max(d[m]["elapsed_s"] for m in ("batch", "sequential"))
            ax.annotate(f"{d['speedup']:.2f}x", (j, top), textcoords="offset points",
                        xytext=(0, 14), ha="center", fontsize=9, weight="bold")
    n = next((e["documents"].get("batch") or e["documents"].get("sequential"))
             ["num_requests"] for _, e in with_docs)
    ax.set_xticks(range(len(with_docs)), [e["system"] for _, e in with_docs])
    ax.set_ylabel("seconds to the last completion")
    ax.set_title(f"{n} documents: all at once (solid) vs one after another (hatched)",
                 fontsize=9)
    ax.margins(y=0.18)
    ax.grid(alpha=0.3, axis="y")


def _title(comparison: dict[str, Any], machine: dict[str, Any]) -> str:
    sweep = comparison["workloads"].get("sweep") or {}
    docs = comparison["workloads"].get("documents") or {}
    parts = []
    if sweep:
        parts.append(f"sweep: {sweep.get('num_prompts')} requests per rate, input "
                     f"{sweep.get('input_len')}, output {sweep.get('output_len')}"
                     f" ({sweep.get('prompt_format')} prompts)")
    if docs:
        parts.append(f"documents: input {docs.get('input_len')}, output "
                     f"{docs.get('output_len')}")
    slo = comparison.get("slo") or {}
    parts.append(f"SLO TTFT {_fmt(slo.get('ttft_ms'), 'g')} ms, TPOT "
                 f"{_fmt(slo.get('tpot_ms'), 'g')} ms; {machine.get('cpu', '?')}")
    return "; ".join(parts)


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        loaded = [(p, load_result(p)) for p in args.results]
        comparison = compare(loaded)
    except CompareError as e:
        print(f"servelm bench compare: error: {e}", file=sys.stderr)
        return 2
    # The machine and commit the runs were taken on, not where compare runs.
    first = loaded[0][1]
    machine = first.get("machine") or machine_info()
    result = {"schema_version": SCHEMA_VERSION, "kind": "serve_compare",
              "command": " ".join(["servelm", "bench", "compare"] + list(args.results)),
              "machine": machine, "commit": first.get("commit") or git_commit(),
              "commits": sorted({r.get("commit") or "?" for _, r in loaded}),
              "sources": [str(p) for p, _ in loaded], **comparison}
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else \
        DEFAULT_RESULTS_DIR / f"serve-compare-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    title = args.title or _title(comparison, machine)
    png = plot_compare(comparison, out.with_suffix(".png"), title)
    print(title)
    print(render_compare_table(comparison))
    print(f"[bench compare] wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `compare` under `servelm bench` (called from servelm/bench/cli.py)."""
    p = bench_sub.add_parser(
        "compare", help="several systems' `bench serve` results side by side (table, JSON, "
                        "one PNG)", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+",
                   help="result JSONs of `bench serve`: one --sweep-rates run per system, and "
                        "documents runs sent all at once and/or with --concurrency 1")
    p.add_argument("--out", default=None, help="combined JSON (default benchmarks/results/"
                   "serve-compare-<UTC time>.json); the PNG goes next to it")
    p.add_argument("--title", default=None, help="the PNG's title (default: the workload)")
    p.set_defaults(func=cmd_compare)
    return p
