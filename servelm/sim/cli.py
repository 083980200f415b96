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
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from servelm.bench.metrics import build_serve_result, goodput, render_serve_table
from servelm.bench.request_trace import read_trace
from servelm.bench.class_workload import class_workload
from servelm.bench.workloads import RandomPrompts, RangeError, parse_range
from servelm.config import SCHEDULING_POLICIES
from servelm.engine.step_cost_model import StepCostModel, StepShape
from servelm.loader.model_cache import DEFAULT_MODEL
from servelm.router.policies import DEFAULT_POLICY, make_policy, policy_help, policy_names
from servelm.sim.arrivals import gamma_offsets, trace_prompts
from servelm.sim.roofline import roofline_from_args
from servelm.sim.fleet import ReplicaSpec, SimRequest, SimResult, simulate
from servelm.slo import (SLOSpec, goodput_by_class, parse_class_lengths, parse_class_mix,
                         spec_from_flags)

SCHEMA_VERSION = 1


class RequestStream:
    """The random workload's SimRequests at their send times, each prompt made as the run
    reaches it (servelm.bench.workloads.RandomPrompts with windows: bench serve's lengths,
    prompts that share no first block as its do; re-iterable, the same requests each
    time): a run of millions holds only the prompts in flight. ids_checked: the prompts'
    ids lie inside the engine's vocabulary (the workload's is no larger)."""

    def __init__(self, prompts: RandomPrompts, offsets, slo, ids_checked: bool):
        self.prompts, self.offsets, self.slo = prompts, offsets, slo
        self.ids_checked = ids_checked

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        slo, checked = self.slo, self.ids_checked
        for t, r in zip(self.offsets, self.prompts):
            yield SimRequest(t, r.prompt_token_ids, r.max_tokens, slo, checked)


def build_requests(args: argparse.Namespace, rate: float | None,
                   engine_vocab_size: int | None = None) -> list[SimRequest] | RequestStream:
    """The workload at `rate` with --arrival's gaps, or (rate None) the --trace's requests
    at their recorded send times. The random workload comes as a RequestStream (in send
    order: its arrival gaps are never negative); engine_vocab_size: the replicas' (their
    engines then skip the per-token check of prompts drawn inside it)."""
    if args.trace is not None:
        trace = read_trace(args.trace)
        prompts = trace_prompts(trace, args.vocab_size, args.seed)
        return [SimRequest(t.arrival_s, p, t.num_replay_tokens) for t, p in zip(trace, prompts)]
    if args.arrival == "diurnal":
        from servelm.sim.autoscale import diurnal_requests

        reqs = diurnal_requests(rate, args.hour_s, args.input_len, args.output_len,
                                args.vocab_size, args.seed)
        slo = slo_spec(args)
        default = slo.get(slo.default_class).request_slo()
        for r in reqs:
            r.slo = default  # the default class: what a request naming none is served as
        return reqs
    slo = slo_spec(args)
    if args.class_mix is not None:  # a mix of SLO classes, each request carrying its class
        mix = parse_class_mix(args.class_mix, slo)
        reqs, classes = class_workload(args.num_prompts, mix,
                                       parse_class_lengths(args.class_len, slo),
                                       args.input_len, args.output_len, args.vocab_size,
                                       args.seed)
        offsets = _offsets(args, len(reqs), rate)
        return [SimRequest(float(t), r.prompt_token_ids, r.max_tokens,
                           slo.get(c).request_slo())
                for t, r, c in zip(offsets, reqs, classes)]
    if args.workload == "conversation":
        from servelm.bench.workloads import conversation

        reqs = conversation(args.num_prompts, args.input_len, args.output_len,
                            args.vocab_size, args.seed)
    else:
        prompts = RandomPrompts(args.num_prompts, args.input_len, args.output_len,
                                args.vocab_size, args.seed, windows=True)
        checked = engine_vocab_size is not None and args.vocab_size <= engine_vocab_size
        return RequestStream(prompts, [float(t) for t in _offsets(args, len(prompts), rate)],
                             slo.get(slo.default_class).request_slo(), checked)
    default = slo.get(slo.default_class).request_slo()
    return [SimRequest(float(t), r.prompt_token_ids, r.max_tokens, default)
            for t, r in zip(_offsets(args, len(reqs), rate), reqs)]


def _offsets(args: argparse.Namespace, num: int, rate: float) -> list[float]:
    from servelm.bench.loadgen import arrival_offsets

    if args.arrival == "gamma":
        return gamma_offsets(num, rate, args.burstiness, seed=args.seed)
    return arrival_offsets(num, rate, args.arrival, burst_size=args.burst_size,
                           seed=args.seed)


def slo_spec(args: argparse.Namespace) -> SLOSpec:
    """--slo-spec FILE, else the one class --slo-ttft-ms / --slo-tpot-ms describe."""
    return spec_from_flags(getattr(args, "slo_spec", None), args.slo_ttft_ms, args.slo_tpot_ms,
                           100 * args.goodput_target)


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
    engine["scheduling_policy"] = getattr(args, "scheduling_policy", "fcfs")
    if engine.get("vocab_size", args.vocab_size) is not None:  # else ReplicaSpec's default
        engine["vocab_size"] = engine.get("vocab_size", args.vocab_size)
    return ReplicaSpec(**engine)


def _load_info(args: argparse.Namespace, rate: float | None,
               requests: list[SimRequest]) -> dict[str, Any]:
    if args.trace is not None:
        span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
        return {"request_rate": (len(requests) - 1) / span if span > 0 else "inf",
                "concurrency": None, "arrival": "trace", "trace": str(args.trace)}
    return {"request_rate": rate, "concurrency": None, "arrival": args.arrival,
            "burst_size": args.burst_size if args.arrival == "burst" else None,
            "burstiness": args.burstiness if args.arrival == "gamma" else None}


def by_quarter(records, slo_ttft_s: float | None, slo_tpot_s: float | None) -> list[dict]:
    """TTFT p50 and goodput of each quarter of the requests in send order: a queue that
    keeps growing shows as TTFT rising quarter after quarter, where the run's totals can
    still look fine."""
    recs = sorted(records, key=lambda r: r.sent_time)
    out = []
    for i in range(4):
        part = recs[len(recs) * i // 4:len(recs) * (i + 1) // 4]
        ttfts = [r.ttft_s for r in part if r.is_ok]
        out.append({"num_requests": len(part),
                    "ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
                    "goodput": goodput(part, slo_ttft_s, slo_tpot_s) if part else None})
    return out


def run_one(args, cost: StepCostModel, spec: ReplicaSpec, rate: float | None,
            num_replicas: int | None = None) -> tuple[dict, SimResult]:
    num_replicas = args.num_replicas if num_replicas is None else num_replicas
    requests = build_requests(args, rate, spec.vocab_size)
    sim = simulate(requests, num_replicas, spec, cost, make_policy(args.policy),
                   bulk=not args.no_bulk, keep_chunk_times=False,
                   shards=num_shards(args.shards, num_replicas))
    slo_ttft = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms is not None else None
    slo_tpot = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "serve", "system": args.label,
        "model": args.model, "command": _command(),
        "load": _load_info(args, rate, requests),
        **build_serve_result(sim.records, sim.elapsed_s, slo_ttft_s=slo_ttft,
                             slo_tpot_s=slo_tpot, itl_ms=sim.itl.summary_ms()),
        "sim": {"cost_model": cost.name, "num_replicas": num_replicas,
                "policy": args.policy, "num_steps": sim.num_steps, "wall_s": sim.wall_s,
                "bulk_decode": not args.no_bulk, "num_bulk_steps": sim.num_bulk_steps,
                "num_mixed_steps": sim.num_mixed_steps,
                "simulated_requests_per_wall_s": sim.requests_per_wall_s,
                "num_shards": sim.num_shards,
                # this process's peak, and each shard's (pages shared since the fork count
                # in each: an upper bound on what the run held at once)
                "max_rss_mb": _max_rss_mb() + sum(sim.shard_max_rss_mb),
                "replicas": [{"num_requests": rep.num_requests,
                              "num_steps": rep.num_steps, "busy_s": rep.busy_s,
                              "num_preemptions": rep.num_preemptions,
                              "max_kv_usage": max((t[1] for t in rep.timeline), default=0.0),
                              "max_waiting": max((t[2] for t in rep.timeline), default=0),
                              "prefix_hit_rate": _hit_rate([rep])}
                             for rep in sim.replica_reports],
                "prefix_hit_rate": _hit_rate(sim.replica_reports),
                "imbalance": _imbalance(sim),
                "by_quarter": by_quarter(sim.records, slo_ttft, slo_tpot),
                "scheduling_policy": spec.scheduling_policy},
    }
    slo = slo_spec(args)
    if isinstance(requests, RequestStream):  # one class: the default
        classes = [requests.slo.slo_class] * len(requests)
    else:
        ordered = sorted(requests, key=lambda r: r.arrival_s)  # the records' order
        classes = [r.slo.slo_class if r.slo else slo.default_class for r in ordered]
    result["slo"] = {"spec": slo.to_dict(), "by_class": goodput_by_class(slo, sim.records,
                                                                         classes)}
    if args.trace is not None:
        result["workload"] = {"kind": "trace", "num_prompts": len(requests),
                              "num_input_tokens": sum(len(r.prompt_token_ids)
                                                      for r in requests),
                              "num_output_tokens": sum(r.max_tokens for r in requests),
                              "seed": args.seed, "vocab_size": args.vocab_size}
    else:
        result["workload"] = {"kind": args.workload, "num_prompts": args.num_prompts,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "seed": args.seed, "vocab_size": args.vocab_size}
    return result, sim


SHARD_MIN_REPLICAS = 4  # --shards auto: a smaller fleet runs in one process


def num_shards(value: str, num_replicas: int) -> int:
    """--shards: a count, or auto (one per usable core for a fleet of SHARD_MIN_REPLICAS
    or more: below, each arrival's exchange costs more than the shards save)."""
    from servelm.sim.shards import usable_cpus

    if value == "auto":
        return usable_cpus() if num_replicas >= SHARD_MIN_REPLICAS else 1
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--shards: a count or auto, got {value!r}") from None
    if n < 1:
        raise ValueError(f"--shards: must be >= 1, got {n}")
    return n


def render_class_table(by_class: dict) -> str:
    """One line per SLO class: requests, met, rejected early, goodput against its target."""
    lines = ["class         requests   met  rejected  goodput  target"]
    for name, row in by_class.items():
        if not row["num_requests"]:
            continue
        lines.append(f"{name:<12} {row['num_requests']:>9} {row['num_met']:>5} "
                     f"{row['num_rejected']:>9} {row['goodput']:>8.1%} {row['target']:>7.0%}")
    return "\n".join(lines)


class ScaledCost:
    """A cost model whose every step takes `scale` times as long (--cost-scale): one
    calibration factor, e.g. fitted to a measured run's TPOT."""

    def __init__(self, inner, scale: float):
        if not 0 < scale < math.inf:
            raise ValueError(f"--cost-scale: must be positive, got {scale}")
        self.inner, self.scale = inner, scale
        self.name = f"{inner.name} x{scale:g}"
        self.fit = {**inner.fit, "scale": scale}
        self.arrival_s = getattr(inner, "arrival_s", 0.0)  # per request, not scaled

    def predict(self, shape) -> float:
        return self.inner.predict(shape) * self.scale

    def step_time(self, *shape) -> float:
        return self.inner.predict(StepShape(*shape)) * self.scale


def _max_rss_mb() -> float:
    """The process's peak resident memory so far (MiB): what the run needed at most."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _hit_rate(replicas) -> float:
    """Prompt tokens found in the prefix caches / prompt tokens looked up (admissions)."""
    hit = sum(rep.prefix_hit_tokens for rep in replicas)
    queried = sum(rep.prefix_query_tokens for rep in replicas)
    return hit / queried if queried else 0.0


def _imbalance(sim: SimResult) -> float:
    """max / mean of the replicas' busy seconds (1.0: perfectly even)."""
    busy = [rep.busy_s for rep in sim.replica_reports]
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean else 1.0


def _command() -> str:
    return " ".join(["servelm", *sys.argv[1:]]) if sys.argv[1:2] == ["sim"] else "servelm sim"


_PLOT_REPLICAS = 16  # lines a timeline plot draws at most
_PLOT_POINTS = 4000  # points a line keeps at most (every n-th step)


def plot_timeline(sim: SimResult, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    shown = sim.replica_reports
    if len(shown) > _PLOT_REPLICAS:  # a fleet of hundreds: an even pick of them
        shown = [shown[i * len(shown) // _PLOT_REPLICAS] for i in range(_PLOT_REPLICAS)]
        title += f" ({_PLOT_REPLICAS} of {len(sim.replica_reports)} replicas shown)"
    for rep in shown:
        line = rep.timeline[::max(1, len(rep.timeline) // _PLOT_POINTS)]
        ts = [t[0] for t in line]
        ax1.plot(ts, [t[1] for t in line], label=f"replica {rep.index}", lw=0.8)
        ax2.plot(ts, [t[2] for t in line], lw=0.8)
    ax1.set_ylabel("KV usage")
    ax2.set_ylabel("waiting requests")
    ax2.set_xlabel("simulated seconds")
    if len(sim.replica_reports) <= 8:
        ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_load_flags(args: argparse.Namespace) -> list[float | None]:
    """The rates to run (None: the trace's own times). Errors name the flag."""
    if args.arrival == "diurnal" and (args.trace is not None or args.sweep_rates):
        raise ValueError("--arrival diurnal: the day's shape peaks at --request-rate; not "
                         "with --trace or --sweep-rates")
    if args.arrival != "diurnal" and args.autoscale is not None:
        raise ValueError("--autoscale: runs over a day: give --arrival diurnal")
    if not 0 < args.hour_s < math.inf:
        raise ValueError(f"--hour-s: must be positive, got {args.hour_s}")
    if args.burstiness is not None and args.arrival != "gamma":
        raise ValueError("--burstiness: only with --arrival gamma")
    if args.arrival == "gamma":
        args.burstiness = 1.0 if args.burstiness is None else args.burstiness
        if not 0 < args.burstiness < math.inf:
            raise ValueError(f"--burstiness: must be positive, got {args.burstiness}")
    if args.trace is not None:
        if not Path(args.trace).is_file():
            raise ValueError(f"--trace: no such file {args.trace}")
        return [None]
    if args.sweep_rates:
        try:
            rates = [float(r) for r in args.sweep_rates.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--sweep-rates: expected comma-separated numbers, got "
                             f"{args.sweep_rates!r}") from None
    else:
        rates = [args.request_rate]
    if not rates or any(not 0 < r < math.inf for r in rates):
        flag = "--sweep-rates" if args.sweep_rates else "--request-rate"
        raise ValueError(f"{flag}: rates must be positive and finite, got "
                         f"{args.sweep_rates or args.request_rate}")
    return rates


def check_fleet_flags(args: argparse.Namespace) -> tuple[int, int] | None:
    """--num-replicas, and --find-replicas LO:HI (returned) with one rate or a trace."""
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas: must be >= 1, got {args.num_replicas}")
    if args.find_replicas is None:
        return None
    if args.sweep_rates:
        raise ValueError("--find-replicas: searches at one rate: give --request-rate or "
                         "--trace, not --sweep-rates")
    try:
        lo, hi = parse_range(args.find_replicas, "--find-replicas")
    except RangeError as e:
        raise ValueError(str(e)) from None
    return lo, hi


def _meets(result: dict, target: float) -> bool:
    """The run's goodput, and every quarter's, at least the target (a growing queue fails
    its last quarters)."""
    quarters = [q["goodput"] for q in result["sim"]["by_quarter"] if q["goodput"] is not None]
    return result["goodput"] >= target and min(quarters, default=0.0) >= target


def find_replicas(args, cost: StepCostModel, spec: ReplicaSpec, rate: float | None,
                  lo: int, hi: int) -> tuple[dict, list[dict]]:
    """Bisect for the fewest replicas in lo..hi whose run meets the goodput target (more
    replicas never hurt); returns that run (or hi's, if none does) and every run tried."""
    tried: list[dict] = []
    runs: dict[int, dict] = {}

    def meets(n: int) -> bool:
        result, sim = run_one(args, cost, spec, rate, n)
        runs[n] = result
        ok = _meets(result, args.goodput_target)
        tried.append({"num_replicas": n, "goodput": result["goodput"],
                      "worst_quarter_goodput": min(
                          (q["goodput"] for q in result["sim"]["by_quarter"]
                           if q["goodput"] is not None), default=None),
                      "ttft_p50_ms_by_quarter": [q["ttft_p50_ms"]
                                                 for q in result["sim"]["by_quarter"]],
                      "meets": ok, "wall_s": sim.wall_s})
        print(f"[sim] {n} replicas: goodput {result['goodput']:.1%}, worst quarter "
              f"{tried[-1]['worst_quarter_goodput']:.1%}: {'meets' if ok else 'misses'} the "
              f"target ({sim.wall_s:.1f} s wall)", file=sys.stderr)
        return ok

    if not meets(hi):
        return runs[hi], tried
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return runs[hi], tried


def cmd_find(args, cost, spec, rate, lo: int, hi: int) -> int:
    from servelm.bench.results import git_commit, machine_info

    result, tried = find_replicas(args, cost, spec, rate, lo, hi)
    found = min((t["num_replicas"] for t in tried if t["meets"]), default=None)
    result.update(machine=machine_info(), commit=git_commit())
    result["replica_search"] = {
        "range": [lo, hi], "goodput_target": args.goodput_target,
        "criterion": "goodput and every quarter's goodput (requests in send order) >= target",
        "num_replicas": found, "tried": sorted(tried, key=lambda t: t["num_replicas"])}
    out = Path(args.out) if args.out else Path("benchmarks/results") / "sim-replicas.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for t in result["replica_search"]["tried"]:
        quarters = ", ".join("-" if q is None else f"{q:.0f}" for q in t["ttft_p50_ms_by_quarter"])
        print(f"{t['num_replicas']:>6} replicas  goodput {t['goodput']:6.1%}  worst quarter "
              f"{t['worst_quarter_goodput']:6.1%}  TTFT p50 by quarter {quarters} ms  "
              f"{'meets' if t['meets'] else 'misses'}")
    if found is None:
        print(f"no replica count in {lo}..{hi} meets goodput >= {args.goodput_target:g}")
    else:
        print(f"fewest replicas meeting goodput >= {args.goodput_target:g} in every quarter: "
              f"{found}")
    print(f"[sim] wrote {out}", file=sys.stderr)
    return 0 if found is not None else 1


def cmd_sim(args: argparse.Namespace) -> int:
    from servelm.bench.results import git_commit, machine_info
    from servelm.bench.sweep import plot_sweep, render_sweep_table, summarize_sweep

    try:
        if args.gpu is None and args.cost_model is None:
            raise ValueError("one of the arguments --cost-model --gpu is required")
        if args.request_rate is None and args.sweep_rates is None and args.trace is None:
            raise ValueError("one of the arguments --request-rate --sweep-rates --trace is "
                             "required")
        cost = roofline_from_args(args) if args.gpu else StepCostModel.load(args.cost_model)
        if args.cost_scale != 1.0:
            cost = ScaledCost(cost, args.cost_scale)
        spec = replica_spec(args, cost)
        if args.vocab_size is None:  # the workload draws from the simulated model's vocabulary
            args.vocab_size = spec.vocab_size
        make_policy(args.policy)
        rates = check_load_flags(args)
        search = check_fleet_flags(args)
        slo = slo_spec(args)
        if args.class_mix is not None:
            parse_class_mix(args.class_mix, slo)
            parse_class_lengths(args.class_len, slo)
        elif args.class_len:
            raise ValueError("--class-len: only with --class-mix")
    except (OSError, ValueError) as exc:
        print(f"servelm sim: error: {exc}", file=sys.stderr)
        return 2
    if args.autoscale is not None:
        from servelm.sim.autoscale_cli import cmd_autoscale

        return cmd_autoscale(args, cost, spec, rates[0])
    if search is not None:
        try:
            return cmd_find(args, cost, spec, rates[0], *search)
        except (OSError, ValueError) as exc:
            print(f"servelm sim: error: {exc}", file=sys.stderr)
            return 2
    what = f"trace {args.trace}" if args.trace is not None else \
        f"{args.num_prompts} requests, input {args.input_len}, output {args.output_len}"
    title = f"servelm sim: {args.num_replicas} x {cost.name}, {args.policy}, {what}"
    runs, sims = [], []
    for rate in rates:
        try:
            result, sim = run_one(args, cost, spec, rate)
        except (OSError, ValueError) as exc:  # a bad trace line, a prompt the engine refuses
            print(f"servelm sim: error: {exc}", file=sys.stderr)
            return 2
        label = "trace" if rate is None else f"rate {rate:g}"
        print(f"[sim] {label}: {len(sim.records)} requests in {sim.wall_s:.2f} s wall "
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
        print(render_class_table(runs[0]["slo"]["by_class"]))
    print(f"[sim] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sim", help="simulate a fleet with servelm's own scheduler",
                              description=__doc__.splitlines()[0])
    # Not required by argparse: `servelm sim validate` takes neither (cmd_sim checks).
    src = p.add_mutually_exclusive_group()
    src.add_argument("--cost-model", help="a step-cost model JSON (servelm bench calibrate)")
    src.add_argument("--gpu", default=None,
                     help="instead: step times from the planner's roofline for this GPU type "
                          "(`servelm plan catalog`), for --model, and KV blocks from its "
                          "memory (servelm/sim/roofline.py)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the model's name in the result; with --gpu, the model simulated "
                        "(as `servelm plan --model`)")
    p.add_argument("--label", default="servelm-sim")
    g = p.add_argument_group("roofline (with --gpu; as servelm plan)")
    g.add_argument("--tp", type=int, default=None,
                   help="GPUs per replica (default: the planner's smallest that fits)")
    g.add_argument("--weight-dtype", default="bf16")
    g.add_argument("--kv-dtype", default="bf16")
    g.add_argument("--mem-util", type=float, default=0.9)
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="planner Calibration JSON (bandwidth_fraction, MFUs, step overhead)")
    g.add_argument("--prefill-mfu", type=float, default=None)
    g.add_argument("--decode-mfu", type=float, default=None)
    g = p.add_argument_group("fleet")
    g.add_argument("--num-replicas", type=int, default=1)
    g.add_argument("--find-replicas", default=None, metavar="LO:HI",
                   help="instead of --num-replicas: bisect for the fewest replicas in LO..HI "
                        "whose run meets --goodput-target overall and in each quarter of the "
                        "requests (one run per count tried)")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names(),
                   help=policy_help())
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: the calibrated engine's)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--autoscale", default=None, metavar="POLICY_FILE",
                   help="instead of a fixed fleet: the autoscaling policy (JSON, "
                        "docs/autoscale.md) sizes it over --arrival diurnal, against a static "
                        "fleet of --static-replicas")
    g.add_argument("--static-replicas", type=int, default=None, metavar="N",
                   help="with --autoscale: the static fleet compared (default: the policy's "
                        "max_replicas; 0: none)")
    g = p.add_argument_group("load (as servelm bench serve)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--request-rate", type=float, default=None)
    mode.add_argument("--sweep-rates", default=None)
    mode.add_argument("--trace", default=None, metavar="FILE",
                      help="replay a JSONL trace (`servelm bench serve --record-requests`): "
                           "its send times, prompts and output lengths; the workload flags "
                           "are not used")
    g.add_argument("--arrival", choices=("poisson", "constant", "burst", "gamma", "diurnal"),
                   default="poisson",
                   help="gaps between requests: exponential, fixed, groups of "
                        "--burst-size, gamma with --burstiness, or diurnal: a day of "
                        "Poisson arrivals peaking at --request-rate, with spikes and longer "
                        "answers in the evening (servelm/sim/autoscale.py; --num-prompts is "
                        "what the day gives)")
    g.add_argument("--hour-s", type=float, default=3600.0,
                   help="with --arrival diurnal: seconds each hour of the day lasts (time "
                        "compression; default %(default)s)")
    g.add_argument("--burst-size", type=int, default=8)
    g.add_argument("--burstiness", type=float, default=None, metavar="CV",
                   help="gamma arrivals: the gaps' coefficient of variation (1: Poisson, "
                        ">1 bursty; the gamma shape is 1/CV^2; default 1)")
    g.add_argument("--workload", choices=("random", "conversation"), default="random",
                   help="random lengths, or multi-turn conversations whose every turn "
                        "extends the last prompt (servelm bench serve's workloads)")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", default="128")
    g.add_argument("--output-len", default="128")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn from [100, vocab-size - 100) (default: "
                        "the vocabulary of the engine the cost model was fitted on)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=100.0)
    g.add_argument("--goodput-target", type=float, default=0.9)
    g.add_argument("--slo-spec", default=None, metavar="FILE",
                   help="the SLO spec (JSON, docs/slo.md): request classes with TTFT/TPOT "
                        "targets and priorities, the same file `servelm serve` reads; "
                        "replaces --slo-ttft-ms / --slo-tpot-ms for the per-class results")
    g.add_argument("--class-mix", default=None, metavar="NAME=SHARE,...",
                   help="requests drawn from the spec's classes with these shares, each "
                        "carrying its class (as a client's slo_class field)")
    g.add_argument("--class-len", action="append", default=None,
                   metavar="NAME=INPUT_LEN/OUTPUT_LEN",
                   help="a class's own prompt and output lengths (repeatable; default "
                        "--input-len / --output-len)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="each replica's scheduler policy (as `servelm serve`); slo predicts "
                        "with the cost model simulated")
    p.add_argument("--cost-scale", type=float, default=1.0, metavar="X",
                   help="every step takes X times the cost model's time (one calibration "
                        "factor; default 1)")
    p.add_argument("--no-bulk", action="store_true",
                   help="run every decode step through the engine (the same result as the "
                        "default bulk advance of plain decode steps, slower: for checking)")
    p.add_argument("--shards", default="auto", metavar="N|auto",
                   help="run the fleet's replicas in N processes, routed as one fleet (the "
                        "same result, faster on N cores; least_loaded only, else one "
                        "process); auto: one per usable core for fleets of at least "
                        f"{SHARD_MIN_REPLICAS} replicas")
    p.add_argument("--out", default=None, help="result JSON (PNG next to it)")
    p.set_defaults(func=cmd_sim)
    from servelm.sim.validate_cli import add_parser as add_validate

    add_validate(p.add_subparsers(dest="sim_command", metavar="validate"))
    return p
