"""One run of benchmarks/cpu/run_router_policies.sh -> summary.json, summary.md, summary.png:
per policy the replicas' prefix-cache hit rate, TTFT and TPOT p50/p99, imbalance, and the
targets (prefix_affinity: >= 2x round_robin's hit rate, lower TTFT p50, imbalance <= 1.25)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ORDER = ("round_robin", "least_loaded", "session", "prefix_affinity")


def row(data: dict) -> dict:
    srv = data.get("server") or {}
    return {"hit_rate": srv.get("prefix_hit_rate"),
            "usage_cached_rate": data.get("usage_cached_tokens_rate"),
            "ttft_p50_ms": data["ttft_ms"]["p50"], "ttft_p99_ms": data["ttft_ms"]["p99"],
            "ttft_later_turns_p50_ms": data["ttft_ms_later_turns"]["p50"],
            "tpot_p50_ms": data["tpot_ms"]["p50"], "tpot_p99_ms": data["tpot_ms"]["p99"],
            "imbalance_requests": srv.get("imbalance_requests"),
            "imbalance_prompt_tokens": srv.get("imbalance_prompt_tokens"),
            "num_completed": data["num_completed"], "num_failed": data["num_failed"],
            "elapsed_s": data["elapsed_s"], "goodput": data["goodput"]}


def hit_rate_bounds(workload: dict, block_size: int = 16, trials: int = 200) -> dict:
    """The run's own conversations, regenerated from its seed: the hit rate of a perfect
    cache-aware router with unbounded pools (each turn finds its previous prompt), and of
    round robin over 2 replicas with unbounded pools (a turn lands on either replica at
    random and finds the longest earlier prompt of its conversation served there, or the
    system prompt), in the replica's full blocks of prompt[:-1]."""
    import numpy as np

    from servelm.bench.multiturn import multi_turn

    def full(n: int) -> int:
        return (n - 1) // block_size * block_size

    # the bounds depend on the lengths alone; runs recorded before the result kept its
    # vocabulary drew from the default model's
    convs = multi_turn(workload["num_conversations"], workload["system_prompt_len"],
                       workload["user_len"], workload["output_len"], workload["turns"],
                       vocab_size=workload.get("vocab_size", 49152), seed=workload["seed"])
    system = full(workload["system_prompt_len"] + 1)
    total = sum(len(t.prompt_token_ids) for c in convs for t in c.turns)
    ideal = sum(system if k == 0 else full(len(c.turns[k - 1].prompt_token_ids) + 1)
                for c in convs for k in range(len(c.turns)))
    rng = np.random.default_rng(0)
    rr = []
    for _ in range(trials):
        hits = 0
        for c in convs:
            best = [system, system]  # longest prompt of this conversation each replica saw
            for t in c.turns:
                r = int(rng.integers(2))
                hits += min(best[r], full(len(t.prompt_token_ids)))
                best[r] = max(best[r], full(len(t.prompt_token_ids) + 1))
        rr.append(hits)
    return {"ideal_unbounded": ideal / total,
            "round_robin_unbounded_2_replicas": float(np.mean(rr)) / total}


def targets(rows: dict) -> dict:
    rr, pa = rows.get("round_robin"), rows.get("prefix_affinity")
    if not rr or not pa or not rr["hit_rate"]:
        return {}
    ratio = pa["hit_rate"] / rr["hit_rate"]
    return {"hit_rate_ratio_vs_round_robin": round(ratio, 3), "hit_rate_2x": ratio >= 2.0,
            "ttft_p50_better": pa["ttft_p50_ms"] < rr["ttft_p50_ms"],
            "imbalance_at_most_1_25": (pa["imbalance_requests"] or 0) <= 1.25}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--command", required=True)
    args = p.parse_args()
    out = Path(args.dir)
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("*.json"))
            if f.stem != "summary"}
    rows = {name: row(runs[name]) for name in ORDER if name in runs}
    first = next(iter(runs.values()))
    summary = {"kind": "router-policies", "command": args.command,
               "machine": first["machine"], "commit": first["commit"],
               "workload": first["workload"], "policies": rows, "targets": targets(rows),
               "hit_rate_bounds": hit_rate_bounds(first["workload"])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = ["| policy | prefix-cache hit rate | TTFT p50 / p99 ms | later turns TTFT p50 ms "
          "| TPOT p50 / p99 ms | imbalance (requests, prompt tokens) | failed |",
          "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        md.append(f"| `{name}` | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} / "
                  f"{r['ttft_p99_ms']:.0f} | {r['ttft_later_turns_p50_ms']:.0f} | "
                  f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | "
                  f"{r['imbalance_requests']:.2f}, {r['imbalance_prompt_tokens']:.2f} | "
                  f"{r['num_failed']} |")
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(json.dumps(summary["targets"]), json.dumps(summary["hit_rate_bounds"]))
    _plot(rows, out / "summary.png", first["machine"])


def _plot(rows: dict, path: Path, machine: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = ((axes[0], "prefix-cache hit rate (replicas' counters)",
               [[rows[n]["hit_rate"] * 100 for n in names]], ["%"]),
              (axes[1], "TTFT (ms)", [[rows[n]["ttft_p50_ms"] for n in names],
                                      [rows[n]["ttft_p99_ms"] for n in names]], ["p50", "p99"]),
              (axes[2], "imbalance, max / mean", [[rows[n]["imbalance_requests"] for n in names],
                                                  [rows[n]["imbalance_prompt_tokens"]
                                                   for n in names]],
               ["requests", "prompt tokens"]))
    for ax, title, series, labels in panels:
        width = 0.8 / len(series)
        for i, (values, label) in enumerate(zip(series, labels)):
            ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
        ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))])
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
        if len(series) > 1:
            ax.legend(fontsize=7)
    axes[2].axhline(1.25, color="grey", linestyle="--", linewidth=0.8)
    fig.suptitle(f"Routing policies, 2 replicas x 1 thread, multi-turn workload "
                 f"({machine.get('cpu', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
