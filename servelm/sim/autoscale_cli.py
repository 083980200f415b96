"""`servelm sim --autoscale POLICY_FILE --arrival diurnal`: the policy over a day, against a
static fleet sized for the peak.

Owns: the run (autoscaled, then static, on the same requests), its JSON (replica-hours of
each, SLO attainment, scale events, the fleet's timeline) and a PNG of replicas and load
over the day.
Never: imports torch; decides anything the policy or the simulated engines decide.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servelm.autoscale.policy import AutoscaleConfig, AutoscaleConfigError
from servelm.bench.metrics import build_serve_result
from servelm.router.policies import make_policy
from servelm.sim.autoscale import AutoscaleResult, simulate_autoscaled
from servelm.sim.fleet import simulate

SCHEMA_VERSION = 1


def _summary(records, elapsed_s: float, slo_ttft, slo_tpot) -> dict[str, Any]:
    full = build_serve_result(records, elapsed_s, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    return {k: full[k] for k in ("num_requests", "num_completed", "num_failed", "goodput",
                                 "ttft_ms", "tpot_ms", "e2e_ms", "slo")}


def _by_hour(records, hour_s: float, slo_ttft, slo_tpot) -> list[float | None]:
    """SLO attainment of the requests sent in each hour of the day."""
    from servelm.bench.metrics import goodput

    hours: dict[int, list] = {}
    for r in records:
        hours.setdefault(int(r.sent_time // hour_s), []).append(r)
    return [goodput(hours[h], slo_ttft, slo_tpot) if h in hours else None for h in range(24)]


def cmd_autoscale(args, cost, spec, peak_rate: float) -> int:
    from servelm.bench.results import git_commit, machine_info
    from servelm.sim.cli import _command, build_requests

    try:
        config = AutoscaleConfig.load(args.autoscale)
        if args.find_replicas is not None:
            raise ValueError("--autoscale: not with --find-replicas")
        static_n = config.max_replicas if args.static_replicas is None else args.static_replicas
        if static_n < 0:
            raise ValueError(f"--static-replicas: must be >= 0, got {static_n}")
        requests = build_requests(args, peak_rate)
    except (OSError, ValueError, AutoscaleConfigError) as exc:
        print(f"servelm sim: error: {exc}", file=sys.stderr)
        return 2
    slo_ttft = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms is not None else None
    slo_tpot = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None
    auto = simulate_autoscaled(requests, spec, cost, make_policy(args.policy), config)
    print(f"[sim] autoscaled ({config.signal}): {len(auto.records)} requests, "
          f"{len(auto.events)} scale events, {auto.replica_s / args.hour_s:.1f} replica-hours in "
          f"{auto.wall_s:.1f} s wall", file=sys.stderr)
    day_s = 24 * args.hour_s
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "autoscale_sim", "system": args.label,
        "model": args.model, "command": _command(), "machine": machine_info(),
        "commit": git_commit(), "cost_model": cost.name, "policy": asdict(config),
        "routing": args.policy,
        "workload": {"kind": "diurnal", "peak_request_rate": peak_rate, "hour_s": args.hour_s,
                     "num_prompts": len(requests), "input_len": args.input_len,
                     "output_len": args.output_len, "seed": args.seed},
        "autoscaled": _auto_summary(auto, slo_ttft, slo_tpot, args.hour_s),
    }
    if static_n:
        static = simulate(requests, static_n, spec, cost, make_policy(args.policy),
                          bulk=not args.no_bulk)
        # The static fleet is paid for the whole day (or the run, if it ran over).
        static_s = static_n * max(day_s, auto.elapsed_s)
        result["static"] = {
            "num_replicas": static_n, "replica_hours": static_s / args.hour_s,
            "replica_s": static_s,
            **_summary(static.records, static.elapsed_s, slo_ttft, slo_tpot),
            "goodput_by_hour": _by_hour(static.records, args.hour_s, slo_ttft, slo_tpot)}
        result["replica_hours_saved"] = 1 - auto.replica_s / static_s
        print(f"[sim] static {static_n} replicas: {static_s / args.hour_s:.1f} replica-hours, "
              f"goodput {result['static']['goodput']:.1%} ({static.wall_s:.1f} s wall)",
              file=sys.stderr)
    out = Path(args.out) if args.out else Path("benchmarks/results") / "sim-autoscale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result["timeline"] = [[round(s.time_s, 3), s.num_ready, s.num_booting, s.num_draining,
                           round(s.signal, 3), round(s.arrival_rate, 3),
                           round(s.tokens_in_flight)] for s in auto.timeline]
    result["timeline_columns"] = ["time_s", "ready", "booting", "draining", "signal",
                                  "arrival_rate", "tokens_in_flight"]
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_autoscale(auto, result, out.with_suffix(".png"))
    a = result["autoscaled"]
    print(f"autoscaled ({config.signal}): {a['replica_hours']:.1f} replica-hours, SLO "
          f"attainment {a['goodput']:.1%}, {a['num_scale_events']} scale events "
          f"({a['num_scale_ups']} up, {a['num_scale_downs']} down), at most "
          f"{a['max_replicas']} replicas, {a['num_failed']} failed")
    if static_n:
        s = result["static"]
        print(f"static {static_n}: {s['replica_hours']:.1f} replica-hours, SLO attainment "
              f"{s['goodput']:.1%}; autoscaling saves {result['replica_hours_saved']:.1%}")
    print(f"[sim] wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def _auto_summary(auto: AutoscaleResult, slo_ttft, slo_tpot, hour_s: float) -> dict:
    ups = [e for e in auto.events if e.delta > 0]
    return {
        # In hours of the day (virtual seconds / hour_s): the day's time is compressed.
        "replica_hours": auto.replica_s / hour_s, "replica_s": auto.replica_s,
        "max_replicas": auto.max_replicas,
        "num_scale_events": len(auto.events), "num_scale_ups": len(ups),
        "num_scale_downs": len(auto.events) - len(ups),
        "replicas_started": sum(e.delta for e in ups),
        **_summary(auto.records, auto.elapsed_s, slo_ttft, slo_tpot),
        "goodput_by_hour": _by_hour(auto.records, hour_s, slo_ttft, slo_tpot),
        "events": [[round(e.time_s, 3), e.delta, e.num_replicas, round(e.signal, 3), e.reason]
                   for e in auto.events],
        "wall_s": auto.wall_s, "num_steps": auto.num_steps,
    }


def plot_autoscale(auto: AutoscaleResult, result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hour_s = result["workload"]["hour_s"]
    t = [s.time_s / hour_s for s in auto.timeline]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax1.step(t, [s.num_ready for s in auto.timeline], where="post", label="ready")
    ax1.step(t, [s.num_ready + s.num_booting for s in auto.timeline], where="post",
             label="ready + booting", alpha=0.7)
    if "static" in result:
        ax1.axhline(result["static"]["num_replicas"], color="grey", ls="--",
                    label="static (peak)")
    ax1.set_ylabel("replicas")
    ax1.legend(fontsize=7, loc="upper left")
    ax2.plot(t, [s.arrival_rate for s in auto.timeline], lw=0.6, label="arrivals / s")
    ax2.set_ylabel("requests / s")
    ax3 = ax2.twinx()
    ax3.plot(t, [s.tokens_in_flight / 1000 for s in auto.timeline], lw=0.6, color="C3",
             label="tokens in flight (k)")
    ax3.set_ylabel("tokens in flight (k)")
    ax2.set_xlabel("hour of the day")
    ax2.legend(fontsize=7, loc="upper left")
    ax3.legend(fontsize=7, loc="upper right")
    a = result["autoscaled"]
    fig.suptitle(f"servelm sim --autoscale ({result['policy']['signal']}): "
                 f"{a['replica_hours']:.1f} replica-h, SLO {a['goodput']:.1%}, "
                 f"{a['num_scale_events']} scale events", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["cmd_autoscale", "plot_autoscale"]
