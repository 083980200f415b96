"""`servelm bench batch-knee`: a batch beside interactive traffic at the knee, as a record.

Owns: the record's schedule on one server (the knee, measured by a sweep unless given, then
confirmed over the long duration; interactive traffic at the knee for a fixed time without a
batch; the same traffic again with
a batch of --batch-lines requests submitted through the official `openai` client's files and
batches API at its start; the same batch alone on the idle server), the progress lines and the
time estimate, and the record: batch-knee.json, batch-knee.md, batch-knee.png under
benchmarks/results/batch-knee-TS/ with the command, the machine and the commit.
Never: judges anything but its own two numbers (interactive goodput with the batch against
without it, the goal within --goal-points; the batch's completion time against what the
idle capacity allowed), or runs beside another record: the numbers are this machine's alone.

The server runs the batch lines as the lowest SLO class (servelm/server/batch_runner.py) under
`--scheduling-policy slo` with a two-class spec (interactive, batch), without the prefix cache
(the two interactive runs send the same seeded requests; a cache would help the second).
Interactive traffic is `servelm bench serve` (its own process) at --knee req/s for --duration.

The sustained knee. A short sweep (128 requests a rate, ~40 s) does not see a queue that
builds for minutes, so its knee can be past what the server sustains for --duration. Unless
--confirm-trials is 0, the knee (the sweep's, or --knee) is confirmed by runs as long as the
measured ones: a run at the knee whose goodput meets --goodput-target confirms it; one that
misses it bisects down between 0 and that rate (`sustained_knee`), at most --confirm-trials
runs, until the bracket is within --confirm-tol of its top; the highest rate that met it is
the knee, and its run is the interactive run without the batch. No rate met in the trials:
an error (give a lower --knee).

    idle capacity    the batch alone: lines/s and output tokens/s the server finishes
    idle share       1 - interactive output tok/s (without the batch) / the batch's alone
    expected time    the batch at alone-speed x idle share while the interactive run lasts,
                     at alone-speed after it: what the batch could take if it used exactly
                     the capacity the interactive traffic left (efficiency = expected/actual)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from servelm.launch import DEVNULL, ProcessHandle, ProcessSpec, Supervisor
from servelm.loader.model_cache import DEFAULT_MODEL

SERVER_START_S = 35.0  # stop, load the model, answer /v1/models (estimate)
DRAIN_S = 18.0  # a client run beyond its sends: its start, warm-ups, the last answers
CAPACITY = 1.2  # the server's throughput over the goodput knee (as sim validate estimates)
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class BatchKneePlan:
    model: str = DEFAULT_MODEL
    threads: int = 2
    max_num_seqs: int = 64
    knee: float | None = None  # req/s; None: a sweep measures it
    sweep_rates: tuple[float, ...] = (2, 3, 4, 4.5, 5, 5.5, 6, 7, 8)
    sweep_prompts: int = 128
    duration_s: float = 300.0  # each interactive run
    batch_lines: int = 2000
    input_len: str = "130:500"
    output_len: str = "64:128"
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    goodput_target: float = 0.9
    goal_points: float = 5.0  # interactive goodput may drop at most this much with the batch
    batch_max_inflight: int = 8
    idle_run: bool = True  # the batch alone after (its idle capacity)
    confirm_trials: int = 4  # long runs to confirm the knee (0: take it as it is)
    confirm_tol: float = 0.1  # bisection stops within this share of the bracket's top
    poll_s: float = 2.0
    serve_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.knee is not None and not self.knee > 0:
            raise ValueError(f"--knee: must be positive, got {self.knee}")
        if self.knee is None and len(self.sweep_rates) < 2:
            raise ValueError("--sweep-rates: give at least two rates (or --knee)")
        for flag in ("duration_s", "poll_s"):
            if not getattr(self, flag) > 0:
                name = "--duration" if flag == "duration_s" else "--poll"
                raise ValueError(f"{name}: must be positive, got {getattr(self, flag)}")
        if self.confirm_trials < 0:
            raise ValueError(f"--confirm-trials: must be >= 0, got {self.confirm_trials}")
        if not 0 < self.confirm_tol < 1:
            raise ValueError(f"--confirm-tol: must be in (0, 1), got {self.confirm_tol}")
        for flag in ("batch_lines", "threads", "max_num_seqs", "sweep_prompts",
                     "batch_max_inflight"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got "
                                 f"{getattr(self, flag)}")
        if not 0 < self.goodput_target <= 1:
            raise ValueError(f"--goodput-target: must be in (0, 1], got {self.goodput_target}")

    def knee_guess(self) -> float:
        return self.knee or sorted(self.sweep_rates)[len(self.sweep_rates) // 2]


def estimate_s(plan: BatchKneePlan, knee: float | None = None) -> dict[str, float]:
    """Each phase's expected seconds: the batch alone at CAPACITY x the knee, beside the
    interactive run at the (CAPACITY - 1) x knee it leaves; the knee's confirmation as two
    long runs (one missed, one met: up to --confirm-trials), the second of which is the
    interactive run without the batch."""
    knee = knee or plan.knee_guess()
    cap = CAPACITY * knee
    out = {"server": SERVER_START_S}
    if plan.knee is None:
        out["sweep"] = sum(plan.sweep_prompts / min(r, cap) + DRAIN_S for r in plan.sweep_rates)
    out["interactive"] = plan.duration_s + DRAIN_S
    if plan.confirm_trials > 1:
        out["confirm"] = plan.duration_s + DRAIN_S  # the run before the one that met it
    beside = (cap - knee) * plan.duration_s
    out["with_batch"] = max(plan.duration_s + DRAIN_S, plan.duration_s
                            + max(0.0, plan.batch_lines - beside) / cap)
    if plan.idle_run:
        out["batch_alone"] = plan.batch_lines / cap + DRAIN_S
    return out


class Progress:
    """Phase lines and the time left (the estimate, scaled by how the finished phases ran)."""

    def __init__(self, estimates: dict[str, float]):
        self.t0 = time.monotonic()
        self.estimates, self.spent, self.spent_est = dict(estimates), 0.0, 0.0

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        left = sum(self.estimates.values())
        ratio = self.spent / self.spent_est if self.spent_est else 1.0
        print(f"[batch-knee] {text} ({elapsed / 60:.1f} min elapsed, about "
              f"{ratio * left / 60:.0f} min left)", file=sys.stderr, flush=True)

    def done(self, phase: str, took_s: float) -> None:
        est = self.estimates.pop(phase, 0.0)
        self.spent += took_s
        self.spent_est += est
        self.say(f"{phase}: {took_s:.0f} s")


class KneeServer:
    """`servelm serve` in its own process group (a launcher ProcessSpec), its state store in
    a folder of its own that goes with it."""

    def __init__(self, plan: BatchKneePlan, spec_path: Path, log: Path, ready_timeout_s: float):
        from servelm.launch import TO_STDERR, HttpHealth, ProcessSpec, Supervisor

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._state = tempfile.TemporaryDirectory(prefix="servelm-batch-knee-")
        # served under the name the clients send (the model as given: a path, a registry name)
        cmd = [sys.executable, "-m", "servelm.cli", "serve", plan.model, "--host", "127.0.0.1",
               "--served-model-name", plan.model,
               "--port", str(self.port), "--threads", str(plan.threads), "--max-num-seqs",
               str(plan.max_num_seqs), "--no-prefix-cache", "--no-log-requests",
               "--scheduling-policy", "slo", "--slo-spec", str(spec_path),
               "--batch-max-inflight", str(plan.batch_max_inflight),
               "--state-store", f"sqlite:///{self._state.name}/state.sqlite3",
               *plan.serve_args]
        spec = ProcessSpec(f"batch-knee server {self.url}", tuple(cmd),
                           readiness=HttpHealth(f"{self.url}/v1/models", probe_timeout_s=2.0),
                           ready_timeout_s=ready_timeout_s, stdout=TO_STDERR,
                           stderr=str(log), new_session=True)
        self.command = cmd
        self.handle = Supervisor(stop_at_exit=False).start(spec)  # LaunchError: why not

    def stop(self) -> None:
        self.handle.stop(grace_s=60.0)
        self._state.cleanup()


def slo_spec(plan: BatchKneePlan) -> dict[str, Any]:
    """Interactive (the default class, the record's SLO) and batch, the lowest."""
    return {"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": plan.slo_ttft_ms,
         "tpot_ms": plan.slo_tpot_ms, "percentile": round(100 * plan.goodput_target, 3),
         "reject_early": False},
        {"name": "batch", "priority": 1, "ttft_ms": 3_600_000, "tpot_ms": 60_000,
         "percentile": 50, "reject_early": False}],
        "default_class": "interactive"}


def batch_input(plan: BatchKneePlan, seed: int) -> tuple[bytes, int]:
    """The batch's JSONL (completions of random token ids, the interactive traffic's
    shapes) and the output tokens it asks for."""
    from servelm.bench.vocab import workload_vocab_size
    from servelm.bench.workloads import random_lengths

    vocab = workload_vocab_size(plan.model, None)
    lines, num_out = [], 0
    for i, req in enumerate(random_lengths(plan.batch_lines, plan.input_len, plan.output_len,
                                           vocab, seed)):
        body = {"model": plan.model, "prompt": req.prompt_token_ids,
                "max_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                 "url": "/v1/completions", "body": body}))
        num_out += req.max_tokens
    return ("\n".join(lines) + "\n").encode(), num_out


def interactive(plan: BatchKneePlan, url: str, rate: float | None, out: Path,
                log: Path) -> ProcessHandle:
    """`servelm bench serve` at `rate` for --duration (None: the knee sweep), started by the
    launcher; its stderr is appended to `log`."""
    cmd = [sys.executable, "-m", "servelm.cli", "bench", "serve", "--base-url", url,
           "--model", plan.model, "--label", "servelm", "--prompt-format", "ids",
           "--input-len", plan.input_len, "--output-len", plan.output_len,
           "--slo-ttft-ms", str(plan.slo_ttft_ms), "--slo-tpot-ms", str(plan.slo_tpot_ms),
           "--goodput-target", str(plan.goodput_target), "--no-progress", "--out", str(out),
           "--seed", "0"]
    if rate is None:
        cmd += ["--sweep-rates", ",".join(f"{r:g}" for r in plan.sweep_rates),
                "--num-prompts", str(plan.sweep_prompts)]
    else:
        cmd += ["--request-rate", f"{rate:g}", "--duration", f"{plan.duration_s:g}"]
    spec = ProcessSpec(f"batch-knee client {out.name}", tuple(cmd), stdout=DEVNULL,
                       stderr=str(log))
    return Supervisor(stop_at_exit=False).start(spec)


def _wait(proc: ProcessHandle, what: str) -> None:
    code = proc.wait_or_kill(None)
    if code != 0:
        raise RuntimeError(f"{what} exited with status {code} (see clients.log)")


def sustained_knee(start: float, sustains, max_trials: int, rel_tol: float
                   ) -> tuple[float | None, list[tuple[float, bool]]]:
    """The highest rate at most `start` that `sustains(rate)` (one long run: True when its
    goodput met the target) confirms, by bisection down from `start` between 0 and the
    lowest rate that missed: at most max_trials runs, stopping once the bracket [met,
    missed] is within rel_tol of its top. Returns (that rate or None if none met, the
    (rate, met) trials in order). Rates are rounded to 3 significant digits."""
    trials: list[tuple[float, bool]] = []
    lo, hi, rate = 0.0, start, start
    while len(trials) < max_trials:
        met = bool(sustains(rate))
        trials.append((rate, met))
        if met:
            lo = rate
        else:
            hi = rate
        if lo == start or (lo > 0 and hi - lo <= rel_tol * hi):
            break
        rate = float(f"{(lo + hi) / 2:.3g}")
        if rate in (lo, hi):  # the rounding has no rate left between them
            break
    return (lo if lo > 0 else None), trials


def measured_knee(sweep: dict, plan: BatchKneePlan) -> float:
    """The highest swept rate whose goodput meets the target (bench/sweep.py)."""
    from servelm.bench.sweep import bracketed_max_rate

    return bracketed_max_rate(sweep["summary"], "give --sweep-rates around it, or --knee")


class BatchWatch:
    """One batch through the official client: upload, create, poll; its progress samples
    (seconds since submission, lines finished) and its final object."""

    def __init__(self, client, jsonl: bytes, name: str):
        self.client, self.name = client, name
        upload = client.files.create(file=(f"{name}.jsonl", jsonl), purpose="batch")
        self.t0 = time.monotonic()
        self.batch = client.batches.create(input_file_id=upload.id, completion_window="24h",
                                           endpoint="/v1/completions")
        self.samples: list[tuple[float, int]] = [(0.0, 0)]
        self.done_s: float | None = None

    @property
    def num_done(self) -> int:
        counts = self.batch.request_counts
        return 0 if counts is None else counts.completed + counts.failed

    def poll(self) -> bool:
        """True once the batch is in a final status."""
        self.batch = self.client.batches.retrieve(self.batch.id)
        t = time.monotonic() - self.t0
        self.samples.append((round(t, 3), self.num_done))
        if self.batch.status in TERMINAL and self.done_s is None:
            self.done_s = t
        return self.done_s is not None

    def summary(self) -> dict[str, Any]:
        counts = self.batch.request_counts
        return {"id": self.batch.id, "status": self.batch.status,
                "num_lines": None if counts is None else counts.total,
                "num_completed": None if counts is None else counts.completed,
                "num_failed": None if counts is None else counts.failed,
                "completion_s": self.done_s, "progress": self.samples}


def watch(batch: BatchWatch, plan: BatchKneePlan, progress: Progress,
          proc: ProcessHandle | None = None) -> float | None:
    """Poll until the batch is final (and `proc` has exited); returns the seconds since
    submission at which `proc` exited (None without one)."""
    said, proc_s = time.monotonic(), None
    while True:
        finished = batch.poll()
        if proc is not None and proc_s is None and proc.poll() is not None:
            proc_s = time.monotonic() - batch.t0
        if finished and (proc is None or proc_s is not None):
            return proc_s
        if time.monotonic() - said >= max(10.0, plan.poll_s):
            said = time.monotonic()
            t = time.monotonic() - batch.t0
            beside = "" if proc is None or proc_s is not None else ", interactive running"
            progress.say(f"{batch.name}: {batch.num_done}/{plan.batch_lines} lines after "
                         f"{t:.0f} s ({batch.num_done / max(t, 1e-9):.2f} lines/s{beside})")
        time.sleep(plan.poll_s)


def measure(plan: BatchKneePlan, out: Path, ready_timeout_s: float) -> dict[str, Any]:
    """Run the schedule on one server; returns the manifest (the raw results' names, the
    knee, each batch's summary), also written as manifest.json after every phase."""
    import openai

    progress = Progress(estimate_s(plan))
    spec_path = out / "slo-spec.json"
    spec_path.write_text(json.dumps(slo_spec(plan), indent=2) + "\n")
    manifest: dict[str, Any] = {"plan": asdict(plan), "knee_req_s": plan.knee}
    progress.say(f"starting the server ({plan.model}); writing {out}")
    t = time.monotonic()
    server = KneeServer(plan, spec_path, out / "server.log", ready_timeout_s)
    manifest["server_command"] = " ".join(server.command[2:])
    progress.done("server", time.monotonic() - t)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=2)
    try:
        knee = plan.knee or _sweep(plan, server.url, out, progress)
        manifest["knee_req_s"] = manifest["start_knee_req_s"] = knee
        if plan.confirm_trials:
            knee, manifest["confirm"] = _confirm(plan, server.url, knee, out, progress)
            manifest["knee_req_s"] = knee
        else:
            _interactive_alone(plan, server.url, knee, out, progress)
        _save(out, manifest)
        manifest["with_batch"] = _with_batch(plan, client, server.url, knee, out, progress)
        _save(out, manifest)
        if plan.idle_run:
            manifest["batch_alone"] = _batch_alone(plan, client, progress)
            _save(out, manifest)
    finally:
        server.stop()
    return manifest


def _save(out: Path, manifest: dict) -> None:
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _sweep(plan: BatchKneePlan, url: str, out: Path, progress: Progress) -> float:
    progress.say(f"sweep for the knee: {len(plan.sweep_rates)} rates x "
                 f"{plan.sweep_prompts} requests")
    t = time.monotonic()
    _wait(interactive(plan, url, None, out / "sweep.json", out / "clients.log"), "the sweep")
    knee = measured_knee(json.loads((out / "sweep.json").read_text()), plan)
    # the phases left, at the measured knee (the sweep keeps the estimate it ran against)
    left = estimate_s(plan, knee)
    progress.estimates = {k: (v if k == "sweep" else left[k])
                          for k, v in progress.estimates.items()}
    progress.done("sweep", time.monotonic() - t)
    progress.say(f"knee {knee:g} req/s")
    return knee


def _confirm(plan: BatchKneePlan, url: str, start: float, out: Path,
             progress: Progress) -> tuple[float, list[dict[str, Any]]]:
    """The sustained knee (module doc); its run becomes interactive.json."""
    runs: list[dict[str, Any]] = []

    def sustains(rate: float) -> bool:
        path = out / f"confirm-{rate:g}.json"
        progress.say(f"confirming {rate:g} req/s for {plan.duration_s:g} s "
                     f"(run {len(runs) + 1} of at most {plan.confirm_trials})")
        t = time.monotonic()
        _wait(interactive(plan, url, rate, path, out / "clients.log"), "a confirmation run")
        goodput = json.loads(path.read_text())["goodput"]
        met = goodput >= plan.goodput_target
        runs.append({"rate": rate, "goodput": goodput, "met": met, "file": path.name})
        progress.done("confirm" if "confirm" in progress.estimates else "interactive",
                      time.monotonic() - t)
        progress.say(f"{rate:g} req/s: goodput {goodput:.1%} over {plan.duration_s:g} s: "
                     f"{'sustained' if met else 'not sustained'}")
        return met

    knee, _ = sustained_knee(start, sustains, plan.confirm_trials, plan.confirm_tol)
    if knee is None:
        raise RuntimeError(f"no rate met --goodput-target {plan.goodput_target:g} over "
                           f"{plan.duration_s:g} s in {len(runs)} run(s) down to "
                           f"{min(r['rate'] for r in runs):g} req/s: give a lower --knee")
    shutil.copyfile(out / f"confirm-{knee:g}.json", out / "interactive.json")
    return knee, runs


def _interactive_alone(plan, url: str, knee: float, out: Path, progress: Progress) -> None:
    progress.say(f"interactive at {knee:g} req/s for {plan.duration_s:g} s, no batch")
    t = time.monotonic()
    _wait(interactive(plan, url, knee, out / "interactive.json", out / "clients.log"),
          "the interactive run")
    progress.done("interactive", time.monotonic() - t)


def _with_batch(plan, client, url: str, knee: float, out: Path,
                progress: Progress) -> dict[str, Any]:
    jsonl, num_out = batch_input(plan, seed=1)
    progress.say(f"interactive at {knee:g} req/s for {plan.duration_s:g} s with a "
                 f"{plan.batch_lines}-line batch submitted at its start")
    t = time.monotonic()
    batch = BatchWatch(client, jsonl, "with_batch")
    proc = interactive(plan, url, knee, out / "interactive-with-batch.json",
                       out / "clients.log")
    interactive_s = watch(batch, plan, progress, proc)
    _wait(proc, "the interactive run beside the batch")
    progress.done("with_batch", time.monotonic() - t)
    lines_then = max((n for s, n in batch.samples if s <= interactive_s), default=0)
    return {**batch.summary(), "num_output_tokens": num_out,
            "interactive_s": interactive_s, "lines_while_interactive": lines_then}


def _batch_alone(plan, client, progress: Progress) -> dict[str, Any]:
    """Another batch of the same shapes (other ids: no help from anything cached)."""
    jsonl, num_out = batch_input(plan, seed=2)
    progress.say(f"the batch alone on the idle server ({plan.batch_lines} lines)")
    t = time.monotonic()
    batch = BatchWatch(client, jsonl, "batch_alone")
    watch(batch, plan, progress)
    progress.done("batch_alone", time.monotonic() - t)
    return {**batch.summary(), "num_output_tokens": num_out}


# -- the record ----------------------------------------------------------------------------

def _interactive_summary(result: dict) -> dict[str, Any]:
    return {k: result[k] for k in ("num_requests", "num_completed", "num_failed", "goodput",
                                   "request_throughput", "output_tok_s", "elapsed_s")} | {
        "ttft_ms": {q: result["ttft_ms"].get(q) for q in ("p50", "p90", "p99")},
        "tpot_ms": {q: result["tpot_ms"].get(q) for q in ("p50", "p90", "p99")}}


def idle_capacity(with_batch: dict, alone: dict | None, interactive: dict,
                  duration_s: float) -> dict[str, Any] | None:
    """The batch's completion time against what the idle capacity allowed (module doc)."""
    if alone is None or not alone.get("completion_s") or not with_batch.get("completion_s"):
        return None
    lines = with_batch["num_lines"] or 0
    rate = (alone["num_lines"] or 0) / alone["completion_s"]  # lines/s alone
    tok_s = alone["num_output_tokens"] / alone["completion_s"]
    share = max(0.0, 1.0 - interactive["output_tok_s"] / tok_s) if tok_s else 0.0
    beside = rate * share * duration_s  # lines the idle share allowed while interactive ran
    if beside >= lines:
        expected = lines / (rate * share)
    else:
        expected = duration_s + (lines - beside) / rate if rate else math.inf
    actual = with_batch["completion_s"]
    return {"alone_lines_s": rate, "alone_output_tok_s": tok_s, "idle_share": share,
            "expected_s": expected, "actual_s": actual,
            "efficiency": expected / actual if actual else None}


def build_record(out: Path, manifest: dict, command: str) -> dict[str, Any]:
    from servelm.bench.results import git_commit, machine_info

    plan = manifest["plan"]
    alone = _interactive_summary(json.loads((out / "interactive.json").read_text()))
    beside = _interactive_summary(
        json.loads((out / "interactive-with-batch.json").read_text()))
    drop = 100.0 * (alone["goodput"] - beside["goodput"])
    with_batch, batch_alone = manifest["with_batch"], manifest.get("batch_alone")
    return {
        "kind": "batch_knee", "command": command, "server_command": manifest["server_command"],
        "machine": machine_info(plan["threads"]), "commit": git_commit(),
        "started_at": manifest.get("started_at"), "plan": plan,
        "knee_req_s": manifest["knee_req_s"],
        "knee_source": _knee_source(plan, manifest), "knee_confirm": manifest.get("confirm"),
        "interactive": {"without_batch": alone, "with_batch": beside,
                        "goodput_drop_points": drop, "goal_points": plan["goal_points"],
                        "met": drop <= plan["goal_points"]},
        "batch": {"with_interactive": with_batch, "alone": batch_alone,
                  "idle_capacity": idle_capacity(with_batch, batch_alone, alone,
                                                 plan["duration_s"])}}


def _knee_source(plan: dict, manifest: dict) -> str:
    source = "given" if plan["knee"] else "sweep (sweep.json)"
    runs = manifest.get("confirm")
    if runs:
        start = manifest.get("start_knee_req_s", runs[0]["rate"])
        source += (f" {start:g} req/s, sustained at {manifest['knee_req_s']:g} req/s over "
                   f"{plan['duration_s']:g} s ({len(runs)} confirmation run(s))")
    return source


def render_markdown(rec: dict[str, Any]) -> str:
    it, batch = rec["interactive"], rec["batch"]
    a, b = it["without_batch"], it["with_batch"]
    wb, alone, cap = batch["with_interactive"], batch["alone"], batch["idle_capacity"]
    plan = rec["plan"]

    def ms(d: dict, key: str, q: str) -> str:
        v = d[key].get(q)
        return "-" if v is None else f"{v:.0f}"

    lines = [
        f"# Batch at the knee: {plan['model']}", "",
        f"- command: `{rec['command']}`", f"- server: `{rec['server_command']}`",
        f"- machine: {rec['machine'].get('cpu')} ({rec['machine'].get('threads')} threads)",
        f"- commit: {rec['commit']}",
        f"- knee: {rec['knee_req_s']:g} req/s ({rec['knee_source']}); interactive runs "
        f"{plan['duration_s']:g} s each, input {plan['input_len']}, output "
        f"{plan['output_len']} tokens; SLO TTFT {plan['slo_ttft_ms']:g} ms, TPOT "
        f"{plan['slo_tpot_ms']:g} ms"]
    if rec.get("knee_confirm"):
        lines.append("- confirmation runs: " + ", ".join(
            f"{r['rate']:g} req/s {r['goodput']:.1%} ({'met' if r['met'] else 'missed'})"
            for r in rec["knee_confirm"]))
    lines += [
        "",
        "| interactive | goodput | TTFT p50 / p99 ms | TPOT p50 / p99 ms | req/s |",
        "|---|---|---|---|---|"]
    for name, d in (("without the batch", a), ("with the batch", b)):
        lines.append(f"| {name} | {d['goodput']:.1%} | {ms(d, 'ttft_ms', 'p50')} / "
                     f"{ms(d, 'ttft_ms', 'p99')} | {ms(d, 'tpot_ms', 'p50')} / "
                     f"{ms(d, 'tpot_ms', 'p99')} | {d['request_throughput']:.2f} |")
    verdict = "met" if it["met"] else "not met"
    lines += ["", f"Interactive goodput drop with the batch: {it['goodput_drop_points']:.1f} "
              f"points (goal: within {it['goal_points']:g}): **{verdict}**.", "",
              f"The batch ({wb['num_lines']} lines, status {wb['status']}): "
              f"{_secs(wb['completion_s'])} beside the interactive run "
              f"({wb['lines_while_interactive']} lines done while it ran)"]
    if alone is not None:
        lines[-1] += f"; {_secs(alone['completion_s'])} alone on the idle server"
    lines[-1] += "."
    if cap is not None:
        lines += ["", f"Against the idle capacity: alone the batch finishes "
                  f"{cap['alone_lines_s']:.2f} lines/s ({cap['alone_output_tok_s']:.0f} output "
                  f"tok/s); the interactive traffic left {cap['idle_share']:.0%} of that idle, "
                  f"so using exactly the idle capacity the batch would take "
                  f"{_secs(cap['expected_s'])}; it took {_secs(cap['actual_s'])} "
                  f"(efficiency {cap['efficiency']:.2f})."]
    return "\n".join(lines) + "\n"


def _secs(s: float | None) -> str:
    return "-" if s is None or not math.isfinite(s) else f"{s:.0f} s"


def plot(rec: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it, batch = rec["interactive"], rec["batch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["without batch", "with batch"]
    values = [100 * it["without_batch"]["goodput"], 100 * it["with_batch"]["goodput"]]
    left.bar(names, values, color=["#4c72b0", "#dd8452"])
    left.axhline(values[0] - it["goal_points"], color="gray", ls="--",
                 label=f"goal: within {it['goal_points']:g} points")
    left.set_ylabel("interactive goodput (%)")
    left.set_ylim(0, 105)
    left.set_title(f"interactive at the knee ({rec['knee_req_s']:g} req/s)")
    left.legend(loc="lower right")
    for label, run in (("beside interactive", batch["with_interactive"]),
                       ("alone", batch["alone"])):
        if run:
            t, n = zip(*run["progress"])
            right.plot(t, n, label=f"{label}: {_secs(run['completion_s'])}")
    wb = batch["with_interactive"]
    if wb.get("interactive_s"):
        right.axvspan(0, wb["interactive_s"], color="#dd8452", alpha=0.15,
                      label="interactive traffic")
    right.set_xlabel("seconds since submission")
    right.set_ylabel("batch lines finished")
    right.set_title(f"the {wb['num_lines']}-line batch")
    right.legend(loc="lower right")
    fig.suptitle(f"batch at the knee: {rec['plan']['model']} on {rec['machine'].get('cpu')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_record(out: Path, manifest: dict, command: str) -> dict[str, Any]:
    rec = build_record(out, manifest, command)
    (out / "batch-knee.json").write_text(json.dumps(rec, indent=2) + "\n")
    (out / "batch-knee.md").write_text(render_markdown(rec))
    plot(rec, out / "batch-knee.png")
    return rec


def _plan_from_args(args: argparse.Namespace) -> BatchKneePlan:
    try:
        rates = tuple(float(r) for r in args.sweep_rates.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--sweep-rates: comma-separated numbers, got {args.sweep_rates!r}") \
            from None
    return BatchKneePlan(
        model=args.model, threads=args.threads, max_num_seqs=args.max_num_seqs, knee=args.knee,
        sweep_rates=rates, sweep_prompts=args.sweep_prompts, duration_s=args.duration,
        batch_lines=args.batch_lines, input_len=args.input_len, output_len=args.output_len,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        goodput_target=args.goodput_target, goal_points=args.goal_points,
        batch_max_inflight=args.batch_max_inflight, idle_run=args.idle_run,
        confirm_trials=args.confirm_trials, confirm_tol=args.confirm_tol,
        poll_s=args.poll, serve_args=tuple(args.serve_arg or ()))


def _check_lengths(plan: BatchKneePlan) -> None:
    from servelm.bench.workloads import RangeError, parse_range

    for flag, text in (("--input-len", plan.input_len), ("--output-len", plan.output_len)):
        try:
            parse_range(text, flag)
        except RangeError as e:
            raise ValueError(f"{flag}: {e}") from None


def cmd_batch_knee(args: argparse.Namespace) -> int:
    try:
        plan = _plan_from_args(args)
        _check_lengths(plan)
    except ValueError as exc:
        print(f"servelm bench batch-knee: error: {exc}", file=sys.stderr)
        return 2
    phases = estimate_s(plan)
    if args.estimate:
        print(f"about {sum(phases.values()) / 60:.0f} min at a knee of {plan.knee_guess():g} "
              f"req/s: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in phases.items()))
        return 0
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out or f"benchmarks/results/batch-knee-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    if os.getloadavg()[0] > 1.0:
        print(f"[batch-knee] WARNING: load average {os.getloadavg()[0]:.1f}: the machine is "
              "not quiet; this will not be a record", file=sys.stderr, flush=True)
    import openai

    try:
        manifest = measure(plan, out, args.ready_timeout)
    except (RuntimeError, OSError, openai.OpenAIError) as exc:
        print(f"servelm bench batch-knee: error: {exc} (what ran is in {out})",
              file=sys.stderr)
        return 1
    manifest["started_at"] = stamp
    rec = write_record(out, manifest, _command())
    print(render_markdown(rec))
    print(f"[batch-knee] wrote {out}/batch-knee.json, .md, .png", file=sys.stderr)
    return 0


def _command() -> str:
    rest = sys.argv[1:]
    if rest and rest[0] == "bench":
        rest = rest[1:]
    return " ".join(["servelm", "bench"] + rest)


def add_parser(bench_sub) -> argparse.ArgumentParser:
    d = BatchKneePlan()
    p = bench_sub.add_parser("batch-knee", help="record: a batch beside interactive traffic "
                             "at the knee (run it alone)", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--knee", type=float, default=None, metavar="REQ_S",
                   help="the knee rate; default: measured by a sweep first")
    p.add_argument("--sweep-rates", default=",".join(f"{r:g}" for r in d.sweep_rates))
    p.add_argument("--sweep-prompts", type=int, default=d.sweep_prompts)
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of interactive traffic per run (default %(default)s)")
    p.add_argument("--batch-lines", type=int, default=d.batch_lines,
                   help="requests in the batch (default %(default)s)")
    p.add_argument("--input-len", default=d.input_len, help="prompt tokens A or A:B, "
                   "interactive and batch alike (default %(default)s)")
    p.add_argument("--output-len", default=d.output_len, help="output tokens A or A:B "
                   "(default %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms)
    p.add_argument("--goodput-target", type=float, default=d.goodput_target)
    p.add_argument("--goal-points", type=float, default=d.goal_points,
                   help="the most interactive goodput may drop with the batch (points)")
    p.add_argument("--batch-max-inflight", type=int, default=d.batch_max_inflight,
                   help="the server's batch seats (serve --batch-max-inflight)")
    p.add_argument("--confirm-trials", type=int, default=d.confirm_trials, metavar="N",
                   help="long runs (--duration each) that confirm the knee, bisecting down "
                   "from it while it is not sustained (0: take the knee as it is; default "
                   "%(default)s)")
    p.add_argument("--confirm-tol", type=float, default=d.confirm_tol, metavar="SHARE",
                   help="stop bisecting once the bracket is within this share of its top "
                   "(default %(default)s)")
    p.add_argument("--no-idle-run", dest="idle_run", action="store_false",
                   help="skip the batch alone on the idle server (no idle-capacity figure)")
    p.add_argument("--poll", type=float, default=d.poll_s, metavar="S",
                   help="seconds between batch polls (default %(default)s)")
    p.add_argument("--serve-arg", action="append", default=None, metavar="FLAG",
                   help="one more `servelm serve` flag (repeat), e.g. --serve-arg=--dtype=float32")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S")
    p.add_argument("--out", default=None,
                   help="the record's folder (default benchmarks/results/batch-knee-TS)")
    p.add_argument("--estimate", action="store_true",
                   help="print the schedule's expected duration and stop")
    p.set_defaults(func=cmd_batch_knee)
    return p
