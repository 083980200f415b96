"""`servelm sim validate`: the simulator's validation record on this machine.

Owns: the record's schedule (a sweep for the knee, then R rounds, each a fresh server that
first serves the calibration traffic and then the measured workload at 0.5x, 0.8x, 1x and
1.5x the knee, and a last calibration pass), the server and client processes it runs, the
progress lines and the time estimate, the replay (the calibrated model, and the same model
scaled per measured run for the machine's drift, simulated on the same requests), and the
record's files: validation.json, validation.md, validation.png, and the CI record (ci/).
Never: judges (servelm/sim/validation.py does), or runs anything while another record or
benchmark runs (the bar is about this machine alone: a second load makes both the
calibration and the measurement wrong, and differently wrong).

Every server traces its steps (`--step-trace`); every client run is a window of wall-clock
time in one server's trace. The calibration passes' steps fit the model (the roofline form,
from served steps as `bench calibrate --served-steps`), and each window's steps say how fast
the machine ran then (measured / predicted step time): the passes at the start and the end
are the drift, and the passes either side of a measured run, or the run's own steps, its
drift-aware scale.

    servelm sim validate                       # the record: ~40 min on 2 cores, alone
    servelm sim validate --estimate            # the schedule and its time, nothing run
    servelm sim validate --replay OUT          # judge an existing record again (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from servelm.loader.model_cache import DEFAULT_MODEL
from servelm.sim import validation as V

CAL_FRACTIONS = (0.45, 1.1, 2.2)  # of the knee: the calibration's rates, around the points
# A client run beyond its sends: the last answers (about 9 s at the knee in the records of
# 2026-12-06: 128 requests at 4.5 req/s took 37 s), the client's start, two warm-ups.
DRAIN_S = 18.0
SERVER_START_S = 35.0  # to stop the last server, load the model, answer /v1/models (estimate)
CAPACITY = 1.2  # the server's throughput over the goodput knee (estimate of a run's length)
SKIP_STEPS = 8  # each server's first steps: warm-up, left out of every window


@dataclass(frozen=True)
class ValidationPlan:
    model: str = DEFAULT_MODEL
    threads: int = 2
    max_num_seqs: int = 64
    repeats: int = 5
    knee: float | None = None  # req/s; None: the sweep measures it
    sweep_rates: tuple[float, ...] = (2, 3, 4, 4.5, 5, 5.5, 6, 7, 8)
    sweep_prompts: int = 128
    num_prompts: int = 128
    input_len: str = "130:500"
    output_len: str = "64:128"
    cal_prompts: int = 64
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    goodput_target: float = 0.9

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats: must be >= 1, got {self.repeats}")
        if self.knee is not None and not self.knee > 0:
            raise ValueError(f"--knee: must be positive, got {self.knee}")
        if self.knee is None and len(self.sweep_rates) < 2:
            raise ValueError("--sweep-rates: give at least two rates (or --knee)")
        for flag in ("num_prompts", "sweep_prompts", "cal_prompts", "threads"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")

    def knee_guess(self) -> float:
        return self.knee or sorted(self.sweep_rates)[len(self.sweep_rates) // 2]


@dataclass
class Task:
    kind: str  # sweep | calibration | run
    round: int  # the server it runs on (0-based); calibration passes: their index
    name: str  # sweep | cal | a point's name
    rate: float | None  # req/s (None for the sweep)
    num_prompts: int
    seed: int


def round_tasks(plan: ValidationPlan, knee: float, r: int) -> list[Task]:
    """Server r's tasks after any sweep: calibration pass r, then (but on the last server)
    the measured points, so every measured round is bracketed by two passes."""
    tasks = [Task("calibration", r, "cal", round(f * knee, 4), plan.cal_prompts, 1)
             for f in CAL_FRACTIONS]
    if r < plan.repeats:
        tasks += [Task("run", r, p.name, round(p.fraction * knee, 4), plan.num_prompts, 0)
                  for p in V.POINTS]
    return tasks


def schedule(plan: ValidationPlan, knee: float) -> list[list[Task]]:
    """Per server, its tasks in order: the sweep first when the knee is to be measured."""
    servers = [round_tasks(plan, knee, r) for r in range(plan.repeats + 1)]
    if plan.knee is None:
        servers[0].insert(0, Task("sweep", 0, "sweep", None, plan.sweep_prompts, 0))
    return servers


def estimate_s(plan: ValidationPlan, task: Task, knee: float) -> float:
    """A client run's expected length: its sends, at most at the server's capacity, and a
    tail; a sweep, one such run per rate."""
    cap = CAPACITY * knee
    if task.kind == "sweep":
        return sum(task.num_prompts / min(r, cap) + DRAIN_S for r in plan.sweep_rates)
    return task.num_prompts / min(task.rate, cap) + DRAIN_S


def estimate_total_s(plan: ValidationPlan, knee: float | None = None) -> float:
    knee = knee or plan.knee_guess()
    servers = schedule(plan, knee)
    return sum(SERVER_START_S + sum(estimate_s(plan, t, knee) for t in tasks)
               for tasks in servers)


class Server:
    """`servelm serve` in its own process group, tracing its steps (a ProcessSpec the
    launcher's Supervisor starts, waits for and stops, as a group: servelm/launch/)."""

    def __init__(self, plan: ValidationPlan, trace: Path, log: Path, ready_timeout_s: float):
        from servelm.launch import TO_STDERR, HttpHealth, ProcessSpec, Supervisor

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "servelm.cli", "serve", plan.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--threads", str(plan.threads), "--max-num-seqs",
               str(plan.max_num_seqs), "--no-prefix-cache", "--no-log-requests",
               "--step-trace", str(trace)]
        # No prefix cache: the rounds send the same seeded prompts to their servers, and a
        # replayed trace starts from an empty cache in the simulator. Its own session: stopping
        # the group leaves no engine core behind its front end.
        spec = ProcessSpec(f"validation server {self.url}", tuple(cmd),
                           readiness=HttpHealth(f"{self.url}/v1/models", probe_timeout_s=2.0),
                           ready_timeout_s=ready_timeout_s, stdout=TO_STDERR,
                           stderr=str(log), new_session=True)
        self.handle = Supervisor(stop_at_exit=False).start(spec)  # LaunchError: why not

    def stop(self) -> None:
        """The whole group; the step trace is complete once the server has exited."""
        self.handle.stop(grace_s=60.0)


def bench(plan: ValidationPlan, url: str, task: Task, out: Path, log: Path,
          trace: Path | None) -> None:
    """One `servelm bench serve` run (its own process: the client does not share this
    one's interpreter with anything)."""
    cmd = [sys.executable, "-m", "servelm.cli", "bench", "serve", "--base-url", url,
           "--model", plan.model, "--label", "servelm", "--prompt-format", "ids",
           "--input-len", plan.input_len, "--output-len", plan.output_len,
           "--slo-ttft-ms", str(plan.slo_ttft_ms), "--slo-tpot-ms", str(plan.slo_tpot_ms),
           "--goodput-target", str(plan.goodput_target), "--no-progress", "--out", str(out),
           "--seed", str(task.seed), "--num-prompts", str(task.num_prompts)]
    if task.kind == "sweep":
        cmd += ["--sweep-rates", ",".join(f"{r:g}" for r in plan.sweep_rates)]
    else:
        cmd += ["--request-rate", f"{task.rate:g}", "--warmup", "2"]
    if trace is not None:
        cmd += ["--record-requests", str(trace)]
    with open(log, "a") as f:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f, check=True)


def _windows(result: dict) -> list[tuple[float, float]]:
    """A client result's measured windows (wall clock), one per run of a sweep."""
    runs = result.get("runs") or [result]
    out = []
    for run in runs:
        t0 = datetime.fromisoformat(run["started_at"]).timestamp()
        out.append((t0, t0 + run["elapsed_s"]))
    return out


class Progress:
    """A line per finished task: what ran, how long, and the time left, the estimate scaled
    by how the finished tasks compared with theirs."""

    def __init__(self, total_estimate_s: float, num_tasks: int):
        self.t0 = self.mark = time.monotonic()
        self.left_s, self.num_tasks, self.done = total_estimate_s, num_tasks, 0
        self.spent_est, self.spent = 0.0, 0.0

    def replan(self, left_s: float) -> None:
        self.left_s = left_s

    def since_mark(self) -> float:
        """Seconds since the last finished task (a server's start: and the last one's stop)."""
        return time.monotonic() - self.mark

    def finished(self, what: str, took_s: float, est_s: float) -> None:
        self.mark = time.monotonic()
        self.done += 1
        self.spent += took_s
        self.spent_est += est_s
        self.left_s = max(0.0, self.left_s - est_s)
        ratio = self.spent / self.spent_est if self.spent_est else 1.0
        elapsed = time.monotonic() - self.t0
        print(f"[validate] {self.done}/{self.num_tasks} {what}: {took_s:.0f} s; "
              f"{elapsed / 60:.1f} min elapsed, about {ratio * self.left_s / 60:.0f} min left",
              file=sys.stderr, flush=True)


def measure(plan: ValidationPlan, out: Path, ready_timeout_s: float) -> dict[str, Any]:
    """Run the schedule; returns the manifest (also written as manifest.json after every
    task, so an interrupted record says how far it got)."""
    knee = plan.knee or plan.knee_guess()
    servers = schedule(plan, knee)
    manifest: dict[str, Any] = {"plan": asdict(plan), "knee": plan.knee, "servers": [],
                                "tasks": []}
    progress = Progress(estimate_total_s(plan, knee),
                        sum(len(t) for t in servers) + len(servers))
    print(f"[validate] {len(servers)} servers, {progress.num_tasks} tasks; about "
          f"{progress.left_s / 60:.0f} min (knee {'guessed' if plan.knee is None else 'given'}"
          f" {knee:g} req/s); writing {out}", file=sys.stderr, flush=True)
    for r in range(plan.repeats + 1):
        trace = out / f"steps-{r}.jsonl"
        server = Server(plan, trace, out / f"server-{r}.log", ready_timeout_s)
        manifest["servers"].append({"round": r, "step_trace": trace.name})
        progress.finished(f"server {r} up", progress.since_mark(), SERVER_START_S)
        try:
            if r == 0 and plan.knee is None:
                sweep = Task("sweep", 0, "sweep", None, plan.sweep_prompts, 0)
                _run_task(plan, server, sweep, out, manifest, progress, knee, 0)
                knee = manifest["knee"] = _measured_knee(out / "serve-sweep.json", plan)
                progress.replan(estimate_total_s(plan, knee) - progress.spent_est)
            for i, task in enumerate(round_tasks(plan, knee, r)):
                _run_task(plan, server, task, out, manifest, progress, knee, i)
        finally:
            server.stop()
    return manifest


def _run_task(plan, server, task: Task, out: Path, manifest: dict, progress: Progress,
              knee: float, index: int) -> None:
    stem = {"sweep": "serve-sweep", "calibration": f"cal-{task.round}-{index}",
            "run": f"serve-{task.name}-{task.round}"}[task.kind]
    trace = out / f"trace-{task.name}-{task.round}.jsonl" if task.kind == "run" else None
    est = estimate_s(plan, task, knee)
    t0 = time.time()
    bench(plan, server.url, task, out / f"{stem}.json", out / "clients.log", trace)
    t1 = time.time()
    manifest["tasks"].append({**asdict(task), "result": f"{stem}.json",
                              "trace": trace.name if trace else None, "t0": t0, "t1": t1})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    what = "sweep" if task.kind == "sweep" else f"{task.kind} {task.name} {task.rate:g} req/s"
    progress.finished(f"round {task.round} {what}", t1 - t0, est)


def _measured_knee(path: Path, plan: ValidationPlan) -> float:
    """The highest swept rate whose goodput meets the target (the earlier records' knee;
    bench/sweep.py): the record stops rather than spend its half hour at multiples of a
    wrong knee."""
    from servelm.bench.sweep import bracketed_max_rate

    return bracketed_max_rate(json.loads(path.read_text())["summary"],
                              "give --sweep-rates around it")


# -- the replay and the judgement ---------------------------------------------------------

def load_traces(out: Path, manifest: dict) -> dict[int, tuple]:
    """Each server's (engine, steps, admissions), its warm-up steps left out."""
    from servelm.engine.step_trace import read_timed_trace

    traces = {}
    for srv in manifest["servers"]:
        engine, steps, admissions = read_timed_trace(out / srv["step_trace"])
        traces[srv["round"]] = (engine, steps[SKIP_STEPS:], admissions)
    return traces


def _calibration_windows(manifest: dict) -> dict[int, tuple[float, float]]:
    """Pass r: from its first client's start to its last client's end."""
    spans: dict[int, tuple[float, float]] = {}
    for t in manifest["tasks"]:
        if t["kind"] == "calibration":
            lo, hi = spans.get(t["round"], (t["t0"], t["t1"]))
            spans[t["round"]] = (min(lo, t["t0"]), max(hi, t["t1"]))
    return spans


def fit_model(manifest: dict, traces: dict[int, tuple]):
    """The step-cost model of every calibration pass's served steps (the roofline form),
    with the front end's admission lag, as `bench calibrate --served-steps` fits it."""
    from servelm.bench.calibrate import front_end_lag
    from servelm.bench.results import git_commit, machine_info
    from servelm.engine.step_cost_model import fit_cost_model

    shapes, seconds, admissions = [], [], []
    engines = {json.dumps(e, sort_keys=True) for e, _, _ in traces.values()}
    if len(engines) != 1:
        raise ValueError("the record's servers ran different engines: not one model")
    for r, (t0, t1) in _calibration_windows(manifest).items():
        _, steps, adm = traces[r]
        sel = V.in_window(steps, t0, t1)
        shapes += [st.shape for st in sel]
        seconds += [st.s for st in sel]
        admissions += [a.admission for a in adm if t0 <= a.t <= t1]
    model = fit_cost_model(f"{manifest['plan']['model']}-served", shapes, seconds, "roofline")
    if admissions:
        model.arrival_s, model.fit["admit_s"] = front_end_lag(admissions)
    model.fit.update({"machine": machine_info(), "commit": git_commit(), "source": "served",
                      "skip_steps": SKIP_STEPS, "engine": json.loads(engines.pop())})
    return model


def speeds(model, manifest: dict, traces: dict[int, tuple]) -> list[dict]:
    """The step speed index of every calibration pass and every measured window."""
    rows = []
    for r, (t0, t1) in sorted(_calibration_windows(manifest).items()):
        rows.append({"kind": "calibration", "round": r, "name": "cal", "t": (t0 + t1) / 2,
                     "index": V.speed_index(model, V.in_window(traces[r][1], t0, t1))})
    for t in manifest["tasks"]:
        if t["kind"] == "calibration":
            continue
        result = json.loads((_out(manifest) / t["result"]).read_text())
        runs = result.get("runs") or [result]
        _, steps, admissions = traces[t["round"]]
        for run, (t0, t1) in zip(runs, run_windows(t, runs, admissions)):
            rate = t["rate"] if t["kind"] == "run" else run["load"]["request_rate"]
            rows.append({"kind": t["kind"], "round": t["round"], "name": t["name"],
                         "rate": rate, "t": (t0 + t1) / 2,
                         "index": V.speed_index(model, V.in_window(steps, t0, t1))})
    return rows


def run_windows(task: dict, runs: list[dict], admissions) -> list[tuple[float, float]]:
    """Each measured run's wall-clock window in its server's trace: from the engine taking
    its first request (after the client's warm-up requests) to the next run's first, or the
    client's exit. (A client result's start is stamped to the second only: a tenth of a
    short run.) Without the admissions the trace should hold, the client's own stamps."""
    took = sorted(a.t for a in admissions if task["t0"] <= a.t <= task["t1"])
    warmup = runs[0].get("load", {}).get("num_warmup") or 0
    sizes = [run["num_requests"] for run in runs]
    if len(took) != warmup + sum(sizes):
        return _windows({"runs": runs})
    starts, i = [], warmup
    for n in sizes:
        starts.append(took[i])
        i += n
    return list(zip(starts, starts[1:] + [task["t1"]]))


def _out(manifest: dict) -> Path:
    return Path(manifest["out"])


def simulate_args(argv: list[str]):
    """`servelm sim ARGV` in this process: (cost, replica spec, args), as cmd_sim sets them up."""
    from servelm.cli import build_parser
    from servelm.sim.cli import ScaledCost, check_load_flags, replica_spec
    from servelm.engine.step_cost_model import StepCostModel
    from servelm.sim.roofline import roofline_from_args

    args = build_parser(["sim"]).parse_args(["sim", *argv])
    cost = roofline_from_args(args) if args.gpu else StepCostModel.load(args.cost_model)
    if args.cost_scale != 1.0:
        cost = ScaledCost(cost, args.cost_scale)
    spec = replica_spec(args, cost)
    if args.vocab_size is None:
        args.vocab_size = spec.vocab_size
    return cost, spec, args, check_load_flags(args)


def simulate_cli(argv: list[str]) -> list[dict]:
    """The serve results `servelm sim ARGV` would write (one per rate, or the trace's)."""
    from servelm.sim.cli import run_one

    cost, spec, args, rates = simulate_args(argv)
    return [run_one(args, cost, spec, rate)[0] for rate in rates]


VARIANTS = ("base", "bracket", "in_run")  # the model; x the bracketing passes; x the run's own


class Replay:
    """Simulations of the record's requests on its model, each scale once."""

    def __init__(self, out: Path, plan: ValidationPlan):
        self.model = str(out / "cost-model.json")
        self.slo = ["--slo-ttft-ms", str(plan.slo_ttft_ms), "--slo-tpot-ms",
                    str(plan.slo_tpot_ms), "--goodput-target", str(plan.goodput_target)]
        self.plan, self._cache = plan, {}

    def run(self, load: list[str], scale: float) -> dict:
        key = (tuple(load), round(scale, 4))
        if key not in self._cache:
            self._cache[key] = simulate_cli(["--cost-model", self.model, *self.slo, *load,
                                         "--cost-scale", f"{scale:.4f}"])[0]
        return self._cache[key]

    def sweep_point(self, rate: float, scale: float) -> dict:
        p = self.plan
        return self.run(["--request-rate", f"{rate:g}", "--num-prompts", str(p.sweep_prompts),
                         "--input-len", p.input_len, "--output-len", p.output_len,
                         "--seed", "0"], scale)


def _scale(variant: str, row: dict, passes: list[tuple[float, float]]) -> float:
    if variant == "base":
        return 1.0
    if variant == "bracket":
        return V.bracket_scale(row["t"], passes)
    return row["index"] or 1.0


def compare_points(out: Path, manifest: dict, speed: list[dict], replay: Replay,
                   variant: str) -> dict[str, dict]:
    passes = [(s["t"], s["index"]) for s in speed if s["kind"] == "calibration" and s["index"]]
    rows = {(s["round"], s["name"]): s for s in speed if s["kind"] == "run"}
    points = {}
    for spec in V.POINTS:
        tasks = [t for t in manifest["tasks"] if t["kind"] == "run" and t["name"] == spec.name]
        if not tasks:
            continue
        measured = V.spread([json.loads((out / t["result"]).read_text()) for t in tasks])
        scales = [_scale(variant, rows[(t["round"], t["name"])], passes) for t in tasks]
        # The same seeded requests every round: one trace stands for all.
        sims = [replay.run(["--trace", str(out / tasks[0]["trace"])], s) for s in scales]
        points[spec.name] = {**V.compare(measured, V.simulated_values(sims), spec.rule),
                             "scales": scales}
    return points


def compare_knee(out: Path, speed: list[dict], replay: Replay, variant: str) -> dict | None:
    """The knee rate: where goodput falls to the target, swept and simulated at its rates."""
    from servelm.bench.sweep import goodput_crossing

    path = out / "serve-sweep.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())["summary"]
    rates, target = summary["rates"], summary["goodput_target"]
    passes = [(s["t"], s["index"]) for s in speed if s["kind"] == "calibration" and s["index"]]
    rows = {s["rate"]: s for s in speed if s["kind"] == "sweep"}
    scales = [_scale(variant, rows[r], passes) for r in rates]
    sims = [replay.sweep_point(r, x) for r, x in zip(rates, scales)]
    measured = goodput_crossing(rates, [p["goodput"] for p in summary["points"]], target)
    simulated = goodput_crossing(rates, [s["goodput"] for s in sims], target)
    return {**V.knee_rate(measured, simulated),
            "simulated_goodput": [s["goodput"] for s in sims],
            "measured_goodput": [p["goodput"] for p in summary["points"]], "rates": rates,
            "scales": scales}


def load_manifest(out: Path) -> tuple[dict, ValidationPlan]:
    path = out / "manifest.json"
    if not path.is_file():
        raise ValueError(f"--replay: no manifest.json in {out} (not a validation record)")
    manifest = json.loads(path.read_text())
    manifest["out"] = str(out)
    plan = dict(manifest["plan"])
    plan["sweep_rates"] = tuple(plan["sweep_rates"])
    return manifest, ValidationPlan(**plan)


def analyze(out: Path) -> dict[str, Any]:
    """Fit, replay and judge a record's measured runs; writes validation.json / .md / .png."""
    from servelm.bench.results import git_commit, machine_info

    manifest, plan = load_manifest(out)
    traces = load_traces(out, manifest)
    model = fit_model(manifest, traces)
    model.save(out / "cost-model.json")
    speed = speeds(model, manifest, traces)
    passes = [(s["t"], s["index"]) for s in speed if s["kind"] == "calibration" and s["index"]]
    replay = Replay(out, plan)
    variants = {}
    for variant in VARIANTS:
        points = compare_points(out, manifest, speed, replay, variant)
        knee = compare_knee(out, speed, replay, variant)
        variants[variant] = {"points": points, "knee_rate": knee,
                             "bar": V.judge(points, knee)}
        print(f"[validate] {variant}: bar {'met' if variants[variant]['bar']['met'] else 'not met'}"
              f", mean |error| {variants[variant]['bar']['mean_abs_error']:.1%}",
              file=sys.stderr, flush=True)
    base_err = variants["base"]["bar"]["mean_abs_error"]
    record = {
        "kind": "sim_validation", "plan": asdict(plan), "knee_req_s": manifest["knee"],
        "machine": machine_info(plan.threads), "commit": git_commit(),
        "title": f"servelm sim validate: {plan.model}, R={plan.repeats}",
        "cost_model": {"name": model.name, "form": model.form, "fit": {
            k: model.fit.get(k) for k in ("num_samples", "mean_abs_rel_error",
                                          "p90_abs_rel_error", "by_class")}},
        "drift": V.drift(passes) if passes else None, "speed": speed,
        "points": {n: {"rate": p["rate"], "rule": p["rule"]} | {
            "measured": _measured_of(out, manifest, n)} for n, p in _point_rates(manifest).items()},
        "variants": variants,
        "error_removed": {v: base_err - variants[v]["bar"]["mean_abs_error"] for v in VARIANTS},
        "bar": {"median_tolerance": V.MEDIAN_TOLERANCE, "knee_rate_tolerance":
                V.KNEE_RATE_TOLERANCE, "goodput_points": V.GOODPUT_POINTS}}
    (out / "validation.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "validation.md").write_text(V.render_markdown(record))
    V.plot(record, out / "validation.png")
    write_ci_record(out, manifest, record)
    return record


def _point_rates(manifest: dict) -> dict[str, dict]:
    rules = {p.name: p.rule for p in V.POINTS}
    out = {}
    for t in manifest["tasks"]:
        if t["kind"] == "run" and t["name"] not in out:
            out[t["name"]] = {"rate": t["rate"], "rule": rules[t["name"]]}
    return out


def _measured_of(out: Path, manifest: dict, name: str) -> dict:
    return V.spread([json.loads((out / t["result"]).read_text()) for t in manifest["tasks"]
                     if t["kind"] == "run" and t["name"] == name])


CI_DIR = Path("tests/sim/data/validation-record")  # what tests/sim/test_validation.py replays


def shipped_variant(record: dict) -> str:
    """The claim a CI record replays: the calibrated model if it meets the bar, else the
    first drift-aware variant that does (its scales travel with the record), else base."""
    return next((v for v in VARIANTS if record["variants"][v]["bar"]["met"]), "base")


def write_ci_record(out: Path, manifest: dict, record: dict) -> Path:
    """out/ci: the model, one trace per point (without the prompt ids: the replica has no
    prefix cache, so a replay of random ids of the same lengths is the same run; the
    traces shrink from ~300 KB to ~27 KB), the measured medians and ranges, and the
    shipped variant's scales (one per measured run; the base model's: 1)."""
    variant = shipped_variant(record)
    ci = out / "ci"
    ci.mkdir(exist_ok=True)
    shutil.copy(out / "cost-model.json", ci / "cost-model.json")
    points = {}
    for name, p in record["points"].items():
        task = next(t for t in manifest["tasks"] if t["kind"] == "run" and t["name"] == name)
        lines = []
        for line in (out / task["trace"]).read_text().splitlines():
            row = json.loads(line)
            row.pop("prompt_token_ids", None)
            lines.append(json.dumps(row))
        (ci / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        scales = record["variants"][variant]["points"][name]["scales"]
        points[name] = {**p, "trace": f"{name}.jsonl", "scales": scales}
    chosen = record["variants"][variant]
    doc = {"source": out.name, "commit": record["commit"], "variant": variant,
           "met": chosen["bar"]["met"], "bar": record["bar"], "plan": record["plan"],
           "knee_rate": chosen["knee_rate"], "points": points}
    (ci / "record.json").write_text(json.dumps(doc, indent=2) + "\n")
    return ci


def ship(out: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for f in to.glob("*"):
        f.unlink()
    for f in (out / "ci").glob("*"):
        shutil.copy(f, to / f.name)


def _plan_from_args(args: argparse.Namespace) -> ValidationPlan:
    try:
        rates = tuple(float(r) for r in args.sweep_rates.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--sweep-rates: comma-separated numbers, got {args.sweep_rates!r}") \
            from None
    return ValidationPlan(model=args.model, threads=args.threads,
                          max_num_seqs=args.max_num_seqs, repeats=args.repeats, knee=args.knee,
                          sweep_rates=rates, sweep_prompts=args.sweep_prompts,
                          num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, cal_prompts=args.cal_prompts,
                          slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                          goodput_target=args.goodput_target)


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        if args.replay:
            out = Path(args.replay)
            load_manifest(out)
        else:
            plan = _plan_from_args(args)
            stamp = datetime.utcnow().strftime("%Y%m%dT%H%M%SZ")
            out = Path(args.out or f"benchmarks/results/sim-validation-{stamp}")
    except ValueError as exc:
        print(f"servelm sim validate: error: {exc}", file=sys.stderr)
        return 2
    if not args.replay:
        if args.estimate:
            print(f"{len(schedule(plan, plan.knee_guess()))} servers; about "
                  f"{estimate_total_s(plan) / 60:.0f} min at a knee of {plan.knee_guess():g} "
                  f"req/s (the replay after it: a minute or two)")
            return 0
        if plan.repeats < 5:
            print(f"[validate] WARNING: --repeats {plan.repeats}: the bar's medians and ranges "
                  "want at least 5 runs a point", file=sys.stderr, flush=True)
        if os.getloadavg()[0] > 1.0:
            print(f"[validate] WARNING: load average {os.getloadavg()[0]:.1f}: the machine is "
                  "not quiet; this will not be a record", file=sys.stderr, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        try:
            measure(plan, out, args.ready_timeout)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"servelm sim validate: error: {exc} (what ran is in {out})",
                  file=sys.stderr)
            return 1
    record = analyze(out)
    variant = shipped_variant(record)
    met = record["variants"][variant]["bar"]["met"]
    if met or args.ship:
        ship(out, Path(args.ci_dir))
        print(f"[validate] CI record ({variant}) shipped into {args.ci_dir} (bar met: {met});"
              " commit it", file=sys.stderr)
    print(V.render_markdown(record))
    print(f"[validate] wrote {out}/validation.json, .md, .png", file=sys.stderr)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = ValidationPlan()
    p = subparsers.add_parser("validate", help="the simulator's validation record on this "
                              "machine (run it alone)", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="R: measured rounds, each bracketed by calibration passes")
    p.add_argument("--knee", type=float, default=None, metavar="REQ_S",
                   help="the knee rate; default: measured by a sweep first")
    p.add_argument("--sweep-rates", default=",".join(f"{r:g}" for r in d.sweep_rates))
    p.add_argument("--sweep-prompts", type=int, default=d.sweep_prompts)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests per measured run")
    p.add_argument("--input-len", default=d.input_len)
    p.add_argument("--output-len", default=d.output_len)
    p.add_argument("--cal-prompts", type=int, default=d.cal_prompts,
                   help="requests per calibration rate (rates: "
                        f"{', '.join(f'{f:g}' for f in CAL_FRACTIONS)} x the knee)")
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms)
    p.add_argument("--goodput-target", type=float, default=d.goodput_target)
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S")
    p.add_argument("--out", default=None,
                   help="the record's folder (default benchmarks/results/sim-validation-TS)")
    p.add_argument("--estimate", action="store_true",
                   help="print the schedule's expected duration and stop")
    p.add_argument("--replay", default=None, metavar="OUT",
                   help="judge an existing record's measured runs again (no server)")
    p.add_argument("--ci-dir", default=str(CI_DIR),
                   help="where a record that meets the bar is copied for the CI replay test")
    p.add_argument("--ship", action="store_true",
                   help="copy the CI record even if the bar is not met")
    p.set_defaults(func=cmd_validate)
    return p
