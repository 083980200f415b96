"""`servelm sim`: simulate `servelm bench serve`'s workload against N simulated replicas.

Owns: the flags (the same workload and load flags as `bench serve`, plus the fleet: the cost
model file, replicas, routing policy, replica limits) and the result in bench serve's JSON
schema (kind serve / serve_sweep, system servelm-sim), so that `servelm bench compare`
takes a simulated and a measured run side by side. A PNG next to the JSON: the sweep's
curves, or for one rate each replica's KV usage and queue over time.
Never: imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from servelm.bench.metrics import build_serve_result, render_serve_table
from servelm.bench.workloads import random_lengths
from servelm.loader.model_cache import DEFAULT_MODEL
from servelm.router.policies import make_policy, policy_names
from servelm.sim.cost_model import StepCostModel
from servelm.sim.fleet import ReplicaSpec, SimRequest, SimResult, simulate

SCHEMA_VERSION = 1


def build_requests(args: argparse.Namespace, rate: float) -> list[SimRequest]:
    from servelm.bench.loadgen import arrival_offsets

    if args.workload == "conversation":
        from servelm.bench.workloads import conversation

        reqs = conversation(args.num_prompts, args.input_len, args.output_len,
                            args.vocab_size, args.seed)
    else:
        reqs = random_lengths(args.num_prompts, args.input_len, args.output_len,
                              args.vocab_size, args.seed)
    offsets = arrival_offsets(len(reqs), rate, args.arrival, burst_size=args.burst_size,
                              seed=args.seed)
    return [SimRequest(float(t), r.prompt_token_ids, r.max_tokens)
            for t, r in zip(offsets, reqs)]


def replica_spec(args: argparse.Namespace, cost: StepCostModel) -> ReplicaSpec:
    engine = dict(cost.fit.get("engine", {}))
    engine["eos_token_ids"] = tuple(engine.get("eos_token_ids", (0,)))
    for flag in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len"):
        value = getattr(args, flag)
        if value is not None:
            engine[flag] = value
    if "num_blocks" not in engine:
        raise ValueError("--num-blocks is required: the cost model does not say how many KV "
                         "blocks its engine had")
    if args.no_prefix_cache:
        engine["enable_prefix_caching"] = False
    engine["vocab_size"] = engine.get("vocab_size", args.vocab_size)
    return ReplicaSpec(**engine)


def run_one(args, cost: StepCostModel, spec: ReplicaSpec, rate: float) -> tuple[dict, SimResult]:
    sim = simulate(build_requests(args, rate), args.num_replicas, spec, cost,
                   make_policy(args.policy))
    slo_ttft = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms is not None else None
    slo_tpot = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "serve", "system": args.label,
        "model": args.model, "command": _command(),
        "load": {"request_rate": rate, "concurrency": None, "arrival": args.arrival,
                 "burst_size": args.burst_size if args.arrival == "burst" else None},
        **build_serve_result(sim.records, sim.elapsed_s, slo_ttft_s=slo_ttft,
                             slo_tpot_s=slo_tpot),
        "sim": {"cost_model": cost.name, "num_replicas": args.num_replicas,
                "policy": args.policy, "num_steps": sim.num_steps, "wall_s": sim.wall_s,
                "simulated_requests_per_wall_s": sim.requests_per_wall_s,
                "replicas": [{"num_requests": sum(rep.engine.stats.finished.values()),
                              "num_steps": rep.runner.num_steps, "busy_s": rep.runner.busy_s,
                              "num_preemptions": rep.engine.scheduler.num_preemptions,
                              "max_kv_usage": max((t[1] for t in rep.timeline), default=0.0),
                              "max_waiting": max((t[2] for t in rep.timeline), default=0),
                              "prefix_hit_rate": _hit_rate([rep])}
                             for rep in sim.replicas],
                "prefix_hit_rate": _hit_rate(sim.replicas),
                "imbalance": _imbalance(sim)},
    }
    result["workload"] = {"kind": args.workload, "num_prompts": args.num_prompts,
                          "input_len": args.input_len, "output_len": args.output_len,
                          "seed": args.seed, "vocab_size": args.vocab_size}
    return result, sim


def _hit_rate(replicas) -> float:
    """Prompt tokens found in the prefix caches / prompt tokens looked up (admissions)."""
    hit = queried = 0
    for rep in replicas:
        cache = rep.engine.block_manager.prefix_cache
        if cache is not None:
            hit += cache.stats.num_hit_tokens
            queried += cache.stats.num_query_tokens
    return hit / queried if queried else 0.0


def _imbalance(sim: SimResult) -> float:
    """max / mean of the replicas' busy seconds (1.0: perfectly even)."""
    busy = [rep.runner.busy_s for rep in sim.replicas]
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean else 1.0


def _command() -> str:
    return " ".join(["servelm", *sys.argv[1:]]) if sys.argv[1:2] == ["sim"] else "servelm sim"


def plot_timeline(sim: SimResult, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for rep in sim.replicas:
        ts = [t[0] for t in rep.timeline]
        ax1.plot(ts, [t[1] for t in rep.timeline], label=f"replica {rep.index}", lw=0.8)
        ax2.plot(ts, [t[2] for t in rep.timeline], lw=0.8)
    ax1.set_ylabel("KV usage")
    ax2.set_ylabel("waiting requests")
    ax2.set_xlabel("simulated seconds")
    if len(sim.replicas) <= 8:
        ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_sim(args: argparse.Namespace) -> int:
    from servelm.bench.results import git_commit, machine_info
    from servelm.bench.sweep import plot_sweep, render_sweep_table, summarize_sweep

    try:
        cost = StepCostModel.load(args.cost_model)
        spec = replica_spec(args, cost)
        make_policy(args.policy)
    except (OSError, ValueError) as exc:
        print(f"servelm sim: error: {exc}", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates \
        else [args.request_rate]
    title = (f"servelm sim: {args.num_replicas} x {cost.name}, {args.policy}, "
             f"{args.num_prompts} requests, input {args.input_len}, output {args.output_len}")
    runs, sims = [], []
    for rate in rates:
        result, sim = run_one(args, cost, spec, rate)
        print(f"[sim] rate {rate:g}: {len(sim.records)} requests in {sim.wall_s:.2f} s wall "
              f"({sim.requests_per_wall_s:,.0f} simulated requests / s)", file=sys.stderr)
        result.update(machine=machine_info(), commit=git_commit())
        runs.append(result)
        sims.append(sim)
    out = Path(args.out) if args.out else Path("benchmarks/results") / "sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep_rates:
        summary = summarize_sweep(runs, args.goodput_target)
        doc = {"schema_version": SCHEMA_VERSION, "kind": "serve_sweep", "system": args.label,
               "model": args.model, "command": _command(), "machine": machine_info(),
               "commit": git_commit(), "summary": summary, "runs": runs}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        plot_sweep(summary, out.with_suffix(".png"), title, args.slo_ttft_ms, args.slo_tpot_ms)
        print(render_sweep_table(summary))
    else:
        out.write_text(json.dumps(runs[0], indent=2) + "\n")
        plot_timeline(sims[0], out.with_suffix(".png"), title)
        print(render_serve_table(runs[0]))
    print(f"[sim] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sim", help="simulate a fleet with servelm's own scheduler",
                              description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", required=True,
                   help="a step-cost model JSON (servelm bench calibrate)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model's name in the result")
    p.add_argument("--label", default="servelm-sim")
    g = p.add_argument_group("fleet")
    g.add_argument("--num-replicas", type=int, default=1)
    g.add_argument("--policy", default="round_robin", choices=policy_names())
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: the calibrated engine's)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-cache", action="store_true")
    g = p.add_argument_group("load (as servelm bench serve)")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--request-rate", type=float, default=None)
    mode.add_argument("--sweep-rates", default=None)
    g.add_argument("--arrival", choices=("poisson", "constant", "burst"), default="poisson")
    g.add_argument("--burst-size", type=int, default=8)
    g.add_argument("--workload", choices=("random", "conversation"), default="random",
                   help="random lengths, or multi-turn conversations whose every turn "
                        "extends the last prompt (servelm bench serve's workloads)")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", default="128")
    g.add_argument("--output-len", default="128")
    g.add_argument("--vocab-size", type=int, default=49152)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=100.0)
    g.add_argument("--goodput-target", type=float, default=0.9)
    p.add_argument("--out", default=None, help="result JSON (PNG next to it)")
    p.set_defaults(func=cmd_sim)
    return p
