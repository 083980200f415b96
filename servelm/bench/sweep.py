"""The throughput-latency curve of `servelm bench serve --sweep-rates`.

Owns: find_knee (where latency starts to buy little throughput), goodput_threshold (the rate
at which goodput drops below a target), goodput_crossing (that rate between two grid points),
summarize_sweep and plot_sweep (PNG, matplotlib Agg).
Never: sends requests (serve.py runs each rate through loadgen.py).

Reading the plot: each point is one request rate. Left of the knee, more load buys output
tokens per second for little latency; right of it, latency climbs (TTFT on a server that
queues requests, TPOT on one that batches them all) while throughput flattens. Operate left of the knee and below the rate where goodput falls under
the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Sequence


# The knee: where p50 latency has doubled over its unloaded value.
KNEE_FACTOR = 2.0


class Knee(NamedTuple):
    index: int  # into the runs sorted by request rate
    request_rate: float
    output_tok_s: float
    metric: str  # the latency that bends there: "p50 TTFT" or "p50 TPOT"


def find_knee(latencies: Sequence[float | None], factor: float = KNEE_FACTOR) -> int | None:
    """Index of the knee in latencies measured at increasing request rates: the last point
    before the latency first exceeds `factor` times the lowest value seen at lower rates.
    None when it never does (the sweep stayed on the flat part: sweep higher).

    Why this and not a curvature fit (Kneedle): a short sweep on a shared machine gives
    noisy, non-monotonic points, and a fit then picks the luckiest point; "latency doubled
    over what the server does unloaded" is robust and says what an operator means.
    """
    lowest = None
    for i, y in enumerate(latencies):
        if y is None:
            continue
        if lowest is not None and y > factor * lowest:
            return max(i - 1, 0)
        lowest = y if lowest is None else min(lowest, y)
    return None


def goodput_threshold(rates: Sequence[float], goodputs: Sequence[float],
                      target: float) -> tuple[float | None, float | None]:
    """(highest rate meeting the target before it first fails, first rate below target)
    over runs sorted by rate. (None, r0) when even the lowest rate misses it."""
    best, first_below = None, None
    for rate, g in sorted(zip(rates, goodputs)):
        if g < target:
            first_below = rate
            break
        best = rate
    return best, first_below


def goodput_crossing(rates: Sequence[float], goodputs: Sequence[float],
                     target: float) -> float | None:
    """The rate at which goodput falls to the target, interpolated linearly between the last
    rate meeting it and the first rate below it (goodput_threshold's pair), so the knee is not
    quantized to the sweep's grid: on a grid 0.5 req/s apart near a knee of 4.5, the grid
    alone cannot tell a 10% difference. None when every rate meets the target or even the
    lowest misses it (no bracket to interpolate in)."""
    r0, r1 = goodput_threshold(rates, goodputs, target)
    if r0 is None or r1 is None:
        return None
    at = dict(zip(rates, goodputs))
    g0, g1 = at[r0], at[r1]
    return r0 + (g0 - target) / (g0 - g1) * (r1 - r0)


def summarize_sweep(runs: list[dict[str, Any]], goodput_target: float) -> dict[str, Any]:
    """Knee and goodput threshold over finished runs (each a serve result)."""
    ok = sorted((r for r in runs if not r.get("error")), key=lambda r: r["load"]["request_rate"])
    rates = [r["load"]["request_rate"] for r in ok]
    # A server that admits everything at once (continuous batching, chunked prefill) keeps
    # TTFT low and lets TPOT degrade; one that queues does the opposite. The knee is where
    # the first of the two bends.
    # p50, not p99: a sweep point holds tens of requests, and their p99 is one request.
    knees = []
    for name, key in (("p50 TTFT", "ttft_ms"), ("p50 TPOT", "tpot_ms")):
        i = find_knee([r[key]["p50"] for r in ok])
        if i is not None:
            knees.append((i, name))
    knee = None
    if knees:
        i, name = min(knees, key=lambda k: k[0])  # ties: the first listed
        knee = Knee(i, ok[i]["load"]["request_rate"], ok[i]["output_tok_s"], name)._asdict()
    goodputs = [r["goodput"] for r in ok]
    best, below = goodput_threshold(rates, goodputs, goodput_target)
    return {"rates": rates, "knee": knee,
            "goodput_target": goodput_target, "max_rate_meeting_target": best,
            "first_rate_below_target": below,
            "goodput_crossing_rate": goodput_crossing(rates, goodputs, goodput_target),
            "points": [{"request_rate": r["load"]["request_rate"],
                        "achieved_rate": r["request_throughput"],
                        "output_tok_s": r["output_tok_s"], "goodput": r["goodput"],
                        "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                        "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"]}
                       for r in ok]}


def render_sweep_table(summary: dict[str, Any]) -> str:
    head = f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'goodput':>8} " \
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
    lines = [head, "-" * len(head)]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for p in summary["points"]:
        lines.append(f"{p['request_rate']:>8.3g} {p['achieved_rate']:>8.2f} "
                     f"{p['output_tok_s']:>10.1f} {p['goodput'] * 100:>7.1f}% "
                     f"{f(p['ttft_p50_ms'], '9.0f')} {f(p['ttft_p99_ms'], '9.0f')} "
                     f"{f(p['tpot_p50_ms'], '9.1f')} {f(p['tpot_p99_ms'], '9.1f')}")
    knee = summary.get("knee")
    lines.append("knee: " + (f"{knee['request_rate']:g} req/s ({knee['output_tok_s']:.1f} "
                             f"output tok/s, where {knee['metric']} bends)" if knee
                             else "none found"))
    t = summary["goodput_target"]
    best, below = summary["max_rate_meeting_target"], summary["first_rate_below_target"]
    lines.append(f"goodput >= {t:.0%}: " + (
        "not met at any rate" if best is None else
        f"up to {best:g} req/s" + (f"; below target from {below:g} req/s" if below is not None
                                   else "; met at every rate swept")))
    crossing = summary.get("goodput_crossing_rate")
    if crossing is not None:
        lines[-1] += f" (falls to the target at ~{crossing:.3g} req/s, interpolated)"
    return "\n".join(lines)


def plot_sweep(summary: dict[str, Any], path: Path, title: str, slo_ttft_ms: float | None,
               slo_tpot_ms: float | None) -> Path | None:
    """Three panels: TTFT and TPOT (p50, p99) against output tok/s with the SLO line and the
    knee; goodput against request rate with the target line."""
    points = summary["points"]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    x = [p["output_tok_s"] for p in points]
    knee = summary.get("knee")
    for ax, name, slo in ((axes[0], "ttft", slo_ttft_ms), (axes[1], "tpot", slo_tpot_ms)):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [p[f"{name}_{q}_ms"] for p in points]
            ax.plot(x, [float("nan") if y is None else y for y in ys], style,
                    label=f"{q} {name.upper()}")
        for p in points:
            ax.annotate(f"{p['request_rate']:g}/s", (p["output_tok_s"], p[f"{name}_p99_ms"] or 0),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color="gray")
        if slo is not None:
            ax.axhline(slo, color="red", lw=1, ls=":", label=f"SLO {slo:g} ms")
        if knee is not None:
            kp = points[knee["index"]]
            ax.plot([kp["output_tok_s"]], [kp[f"{name}_p50_ms"] or 0], marker="*", ms=16,
                    color="orange", ls="none", label=f"knee ({knee['request_rate']:g} req/s)")
        ax.set_xlabel("output tok/s")
        ax.set_ylabel(f"{name.upper()} (ms)")
        values = [v for p in points for v in (p[f"{name}_p50_ms"], p[f"{name}_p99_ms"])
                  if v] + ([slo] if slo else [])
        if values and max(values) > 10 * min(values):  # past the knee latency explodes
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    rates = [p["request_rate"] for p in points]
    ax.plot(rates, [p["goodput"] for p in points], "o-", label="goodput")
    target = summary["goodput_target"]
    ax.axhline(target, color="red", lw=1, ls=":", label=f"target {target:.0%}")
    if summary.get("first_rate_below_target") is not None:
        ax.axvline(summary["first_rate_below_target"], color="gray", lw=1, ls="--",
                   label=f"below target at {summary['first_rate_below_target']:g} req/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("share of requests meeting both SLOs")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def bracketed_max_rate(summary: dict, retry_hint: str) -> float:
    """The highest swept rate whose goodput meets the target, where the sweep brackets it.
    A rate at either end of the sweep is not bracketed, and the caller's record stops rather
    than run at a wrong knee (retry_hint: the flags that fix it)."""
    best = summary["max_rate_meeting_target"]
    if best is None or best == max(summary["rates"]):
        where = "below the lowest" if best is None else "at or above the highest"
        raise RuntimeError(f"the knee is {where} of the swept rates {summary['rates']} "
                           f"(goodput {[p['goodput'] for p in summary['points']]}): "
                           f"{retry_hint}")
    return float(best)
