"""The simulator's validation record, judged: simulated runs against repeated measured runs of
the same requests, the machine's drift over the record, and the accepted bar.

Owns: the comparison of a simulated percentile with the median and the range of R measured
runs, a step-speed index (measured over predicted step time) of a window of served steps,
the drift-aware scales (per measured run: from the calibration passes bracketing it in
time, or from the run's own served steps), the bar (docs/sim.md, "The accepted bar"), and
the record's table and plot.
Never: starts a server or a client, or simulates (servelm/sim/validate_cli.py does, and
hands the results in): everything here is arithmetic on result dicts and step lists.

A measured point is R runs of one seeded workload at one rate; a simulated point is one
simulation of that workload (the base model) or R of them (one per measured run, each with
its own drift scale), whose median stands for the simulator's answer:

    point     rate          the bar
    half      0.5 x knee    TTFT, TPOT p50 / p90 / p99 within 15% of the measured median
    light     0.8 x knee    the same
    knee      knee          every simulated percentile inside the measured runs' range
    past      1.5 x knee    goodput within 10 points of the measured median
    (sweep)   the knee rate: where goodput falls to the target, within 10%
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from servelm.engine.step_trace import TimedStep

METRICS = ("ttft_ms", "tpot_ms")
PERCENTILES = ("p50", "p90", "p99")
MEDIAN_TOLERANCE = 0.15  # below the knee: |simulated / measured median - 1|
KNEE_RATE_TOLERANCE = 0.10  # the goodput crossing's rate, relative
GOODPUT_POINTS = 0.10  # past the knee: |simulated - measured median goodput|


class PointSpec(NamedTuple):
    name: str
    fraction: float  # of the knee rate
    rule: str  # "median" | "range" | "goodput"


POINTS = (PointSpec("half", 0.5, "median"), PointSpec("light", 0.8, "median"),
          PointSpec("knee", 1.0, "range"), PointSpec("past", 1.5, "goodput"))


def spread(runs: Sequence[dict]) -> dict[str, Any]:
    """The measured runs of one point: per metric and percentile their values, median, min
    and max; goodput the same."""
    if not runs:
        raise ValueError("spread: no measured runs")
    out: dict[str, Any] = {}
    for key in METRICS:
        out[key] = {p: _summary([r[key][p] for r in runs]) for p in PERCENTILES}
    out["goodput"] = _summary([r["goodput"] for r in runs])
    out["num_runs"] = len(runs)
    return out


def _summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    med = statistics.median(vals)
    return {"median": med, "min": min(vals), "max": max(vals), "values": vals,
            "range_over_median": (max(vals) - min(vals)) / med if med else None}


def simulated_values(sims: Sequence[dict]) -> dict[str, Any]:
    """The simulator's answer at a point: one simulation's percentiles, or the median of
    several (one per measured run, each with its own scale)."""
    if not sims:
        raise ValueError("simulated_values: no simulations")
    out: dict[str, Any] = {key: {p: statistics.median(s[key][p] for s in sims)
                                 for p in PERCENTILES} for key in METRICS}
    out["goodput"] = statistics.median(s["goodput"] for s in sims)
    return out


def compare(measured: dict, simulated: dict, rule: str) -> dict[str, Any]:
    """Per metric and percentile: the simulated value, its error against the measured
    median, whether it lies inside the measured range; and whether the point meets its rule."""
    rows: dict[str, Any] = {}
    for key in METRICS:
        for p in PERCENTILES:
            m, s = measured[key][p], simulated[key][p]
            rows[f"{key[:4]}_{p}"] = {
                "simulated": s, "median": m["median"], "min": m["min"], "max": m["max"],
                "error": (s - m["median"]) / m["median"] if m["median"] else None,
                "in_range": m["min"] <= s <= m["max"]}
    g = measured["goodput"]
    goodput = {"simulated": simulated["goodput"], "median": g["median"], "min": g["min"],
               "max": g["max"], "points": simulated["goodput"] - g["median"]}
    if rule == "median":
        met = all(r["error"] is not None and abs(r["error"]) <= MEDIAN_TOLERANCE
                  for r in rows.values())
    elif rule == "range":
        met = all(r["in_range"] for r in rows.values())
    elif rule == "goodput":
        met = abs(goodput["points"]) <= GOODPUT_POINTS
    else:
        raise ValueError(f"rule: median, range or goodput, got {rule!r}")
    return {"rule": rule, "percentiles": rows, "goodput": goodput, "met": met,
            "mean_abs_error": statistics.fmean(abs(r["error"]) for r in rows.values()
                                               if r["error"] is not None)}


def knee_rate(measured_crossing: float | None, simulated_crossing: float | None) -> dict:
    """The knee rate's bar: where goodput falls to the target, simulated against measured."""
    err = None
    if measured_crossing and simulated_crossing:
        err = (simulated_crossing - measured_crossing) / measured_crossing
    return {"measured_req_s": measured_crossing, "simulated_req_s": simulated_crossing,
            "error": err, "met": err is not None and abs(err) <= KNEE_RATE_TOLERANCE}


def judge(points: dict[str, dict], knee: dict | None) -> dict[str, Any]:
    """The bar over one variant's compared points (and the knee rate, when swept)."""
    met = all(p["met"] for p in points.values())
    if knee is not None:
        met = met and knee["met"]
    return {"met": met, "points_met": {n: p["met"] for n, p in points.items()},
            "knee_rate_met": None if knee is None else knee["met"],
            "mean_abs_error": statistics.fmean(p["mean_abs_error"] for p in points.values())}


def speed_index(model, steps: Sequence[TimedStep]) -> float | None:
    """Measured over predicted total step time: 1.05 means the machine ran these steps 5%
    slower than the model says (the factor a simulation of them wants)."""
    measured = sum(st.s for st in steps)
    predicted = sum(model.predict(st.shape) for st in steps)
    return measured / predicted if predicted > 0 and steps else None


def in_window(steps: Sequence[TimedStep], t0: float, t1: float) -> list[TimedStep]:
    return [st for st in steps if t0 <= st.t <= t1]


def bracket_scale(t: float, passes: Sequence[tuple[float, float]]) -> float:
    """The step speed at time t, interpolated linearly between the calibration passes
    (mid time, speed index) on either side of it; before the first or after the last pass,
    the nearest one's."""
    passes = sorted(passes)
    if not passes:
        raise ValueError("bracket_scale: no calibration passes")
    if t <= passes[0][0]:
        return passes[0][1]
    for (t0, s0), (t1, s1) in zip(passes, passes[1:]):
        if t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1
    return passes[-1][1]


def drift(passes: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The machine's speed over the record: each calibration pass's speed index against the
    model, and the last over the first (above 1: it ran slower at the end)."""
    passes = sorted(passes)
    first, last = passes[0][1], passes[-1][1]
    return {"passes": [{"t": t, "speed_index": s} for t, s in passes],
            "start": first, "end": last, "end_over_start": last / first,
            "min": min(s for _, s in passes), "max": max(s for _, s in passes),
            "minutes": (passes[-1][0] - passes[0][0]) / 60}


def render_markdown(record: dict[str, Any]) -> str:
    """The record's table: per variant, point, metric and percentile."""
    lines = []
    for variant, v in record["variants"].items():
        lines += [f"### {variant}: bar {'met' if v['bar']['met'] else 'NOT met'} "
                  f"(mean |error| {v['bar']['mean_abs_error']:.1%})", "",
                  "| point | rate | rule | metric | measured median [min, max] | simulated "
                  "| error | in range |", "|---|---|---|---|---|---|---|---|"]
        for name, p in v["points"].items():
            rate = record["points"][name]["rate"]
            for metric, r in p["percentiles"].items():
                lines.append(f"| {name} | {rate:g} | {p['rule']} | {metric} | {r['median']:.0f}"
                             f" [{r['min']:.0f}, {r['max']:.0f}] | {r['simulated']:.0f} | "
                             f"{r['error']:+.1%} | {'yes' if r['in_range'] else 'no'} |")
            g = p["goodput"]
            lines.append(f"| {name} | {rate:g} | {p['rule']} | goodput | {g['median']:.0%} "
                         f"[{g['min']:.0%}, {g['max']:.0%}] | {g['simulated']:.0%} | "
                         f"{100 * g['points']:+.0f} points | |")
        k = v.get("knee_rate")
        if k:
            err = "n/a" if k["error"] is None else f"{k['error']:+.1%}"
            lines.append(f"\nKnee rate (goodput crossing): measured {k['measured_req_s']}, "
                         f"simulated {k['simulated_req_s']} req/s ({err})")
        lines.append("")
    removed = record.get("error_removed") or {}
    if removed:
        lines.append("Mean |error| over every point and percentile removed by the drift-aware "
                     "scales: " + ", ".join(f"{v} {100 * e:+.1f} points"
                                           for v, e in removed.items() if v != "base"))
    d = record.get("drift")
    if d:
        lines.append(f"Drift: calibration speed index {d['start']:.3f} at the start, "
                     f"{d['end']:.3f} at the end ({d['end_over_start'] - 1:+.1%} over "
                     f"{d['minutes']:.0f} min; range {d['min']:.3f}-{d['max']:.3f})")
    return "\n".join(lines) + "\n"


def plot(record: dict[str, Any], path: Path) -> Path | None:
    """Per point and metric: the measured runs (dots), their median, and each variant's
    simulated value; below, the step speed index of every calibration pass and run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(record["points"])
    fig, axes = plt.subplots(3, 1, figsize=(9, 9))
    styles = {"base": ("x", "tab:blue"), "bracket": ("^", "tab:green"),
              "in_run": ("v", "tab:red")}
    for ax, key in zip(axes[:2], METRICS):
        for i, name in enumerate(names):
            measured = record["points"][name]["measured"][key]
            for j, p in enumerate(PERCENTILES):
                x = i * 4 + j
                vals = measured[p]["values"]
                ax.scatter([x] * len(vals), vals, s=10, c="grey", alpha=0.6)
                ax.hlines(measured[p]["median"], x - 0.3, x + 0.3, colors="black")
                for variant, v in record["variants"].items():
                    s = v["points"][name]["percentiles"][f"{key[:4]}_{p}"]["simulated"]
                    marker, color = styles.get(variant, ("o", "black"))
                    ax.scatter([x + 0.15], [s], marker=marker, c=color, s=30,
                               label=variant if (i, j) == (0, 0) else None)
        ax.set_xticks([i * 4 + j for i in range(len(names)) for j in range(3)])
        ax.set_xticklabels([f"{n}\n{p}" for n in names for p in PERCENTILES], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(f"{key[:4].upper()} ms")
        ax.legend(fontsize=7)
    ax = axes[2]
    t0 = min(s["t"] for s in record["speed"]) if record.get("speed") else 0.0
    for kind, color in (("calibration", "tab:blue"), ("run", "tab:orange")):
        rows = [s for s in record.get("speed", []) if s["kind"] == kind and s["index"]]
        ax.scatter([(s["t"] - t0) / 60 for s in rows], [s["index"] for s in rows], s=14,
                   c=color, label=kind)
    ax.set_xlabel("minutes into the record")
    ax.set_ylabel("step time measured / model")
    ax.legend(fontsize=7)
    fig.suptitle(record.get("title", "servelm sim validate"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
