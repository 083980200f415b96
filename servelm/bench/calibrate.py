"""`servelm bench calibrate MODEL`: measure engine steps of known shape, fit a StepCostModel;
`servelm bench calibrate --host`: measure this machine's host bandwidths for the planner.

Owns: the calibration workloads (decode batches at several sizes and contexts, prefill
chunks of several lengths, and the mixed steps between them), timing each whole engine step
(schedule + runner + update: what a simulated step stands for), and the fit's report; and
the host measurements (a DRAM copy, a disk read that bypasses the page cache, a pinned
host-to-GPU copy when there is a GPU) written as `servelm plan --calibration` keys.
Never: guesses a coefficient: every figure comes from a step or a copy measured on this
machine; a bandwidth it cannot measure (no GPU) is left out, not filled in.

The model file feeds `servelm sim --cost-model FILE`; its `fit.engine` block records the
engine the steps ran on (KV blocks, limits), which the simulator takes as its replica.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from servelm.engine.step_cost_model import (FORMS, ROOFLINE_FEATURES, StepCostModel, StepShape,
                                    fit_cost_model, step_shape)

# (number of requests, prompt tokens, new tokens): decode batches and prefill chunks.
DEFAULT_PLAN = [(1, 16, 48), (1, 1024, 8), (4, 128, 48), (8, 512, 32), (16, 64, 48),
                (32, 256, 24), (64, 96, 24), (2, 1536, 1), (6, 300, 1)]


class _Recorder:
    """Wraps a runner: remembers the shape of the step it was last given."""

    def __init__(self, inner):
        self.inner = inner
        self.last_shape: StepShape | None = None

    def execute(self, step):
        self.last_shape = step_shape(step)
        return self.inner.execute(step)


def measure_steps(engine, plan=DEFAULT_PLAN, seed: int = 0,
                  progress: bool = True) -> tuple[list[StepShape], list[float]]:
    """Run each (n, prompt, new) group through `engine` alone; every step's shape and wall
    seconds. The first group's steps also warm the engine up and are dropped."""
    import random

    from servelm.protocol import EngineRequest, SamplingParams

    rng = random.Random(seed)
    recorder = _Recorder(engine.runner)
    engine.runner = recorder
    shapes, seconds = [], []
    vocab = engine.vocab_size
    try:
        for g, (n, prompt_len, new) in enumerate([plan[0], *plan]):
            for i in range(n):
                ids = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
                engine.add_request(EngineRequest(f"cal{g}-{i}", ids, SamplingParams(
                    max_tokens=new, temperature=0, ignore_eos=True)))
            while engine.has_unfinished:
                recorder.last_shape = None
                start = time.perf_counter()
                engine.step()
                took = time.perf_counter() - start
                if recorder.last_shape is not None and g > 0:
                    shapes.append(recorder.last_shape)
                    seconds.append(took)
            if progress:
                print(f"[calibrate] {n} x {prompt_len} + {new}: {len(shapes)} steps so far",
                      file=sys.stderr)
    finally:
        engine.runner = recorder.inner
    return shapes, seconds


def calibrate(engine, name: str, plan=DEFAULT_PLAN, progress: bool = True,
              form: str = "linear") -> StepCostModel:
    from servelm.bench.results import git_commit, machine_info

    shapes, seconds = measure_steps(engine, plan, progress=progress)
    model = fit_cost_model(name, shapes, seconds, form)
    bm, sched = engine.block_manager, engine.scheduler.config
    model.fit.update({
        "machine": machine_info(), "commit": git_commit(), "plan": [list(p) for p in plan],
        "engine": {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
                   "max_num_seqs": sched.max_num_seqs,
                   "max_num_batched_tokens": sched.max_num_batched_tokens,
                   "enable_chunked_prefill": sched.enable_chunked_prefill,
                   "enable_prefix_caching": bm.prefix_cache is not None,
                   "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                   "eos_token_ids": sorted(engine.eos_token_ids)},
    })
    return model


def calibrate_served(paths: list[str], name: str, skip_steps: int = 8,
                     form: str = "linear") -> StepCostModel:
    """Fit to the steps `servelm serve --step-trace` recorded (servelm/engine/step_trace.py):
    each step's wall time start to next start, so the model holds what serving spends per
    step, not only the forward. The first `skip_steps` of each file (warm-up) are dropped.
    Every file must come from the same engine (its KV pool and limits).
    arrival_s: the front end's own admission lag (front_end_lag)."""
    from servelm.bench.results import git_commit, machine_info
    from servelm.engine.step_trace import read_step_trace

    if not paths:
        raise ValueError("served_steps: give at least one step-trace file")
    if skip_steps < 0:
        raise ValueError(f"skip_steps must be >= 0, got {skip_steps}")
    engine, shapes, seconds, admissions = None, [], [], []
    for path in paths:
        eng, sh, sec, adm = read_step_trace(path)
        admissions += adm
        if engine is not None and eng != engine:
            raise ValueError(f"served_steps: {path} ran on another engine ({eng}) than "
                             f"{paths[0]} ({engine})")
        engine = eng
        shapes += sh[skip_steps:]
        seconds += sec[skip_steps:]
    model = fit_cost_model(name, shapes, seconds, form)
    if admissions:
        model.arrival_s, model.fit["admit_s"] = front_end_lag(admissions)
    model.fit.update({"machine": machine_info(), "commit": git_commit(), "source": "served",
                      "step_traces": [str(p) for p in paths], "skip_steps": skip_steps,
                      "engine": engine})
    return model


def front_end_lag(admissions) -> tuple[float, dict]:
    """The per-request lag the simulator adds before a request reaches the engine's queue
    (StepCostModel.arrival_s), and a report of the admissions it came from.

    A request taken by an idle loop waited for nothing but the front end (parsing,
    tokenizing, the hop into the engine): the median of those lags, robust to a stalled one.
    A request that arrived during a step also waited for that step to end, which the
    simulator models itself (a simulated request arriving during a step waits for the next):
    counting that wait in arrival_s as well would delay every simulated request by about half
    a step, and make one that arrives near a step's end miss it. With no idle admission the
    smallest lag stands in (an upper bound on the front end's part: the request that arrived
    closest to a step's end)."""
    lags = np.array([a.lag_s for a in admissions], dtype=np.float64)
    idle = np.array([a.lag_s for a in admissions if a.is_idle], dtype=np.float64)
    lag = float(np.median(idle)) if len(idle) else float(lags.min())
    report = {"n": len(lags), "p50": float(np.median(lags)),
              "p90": float(np.percentile(lags, 90)), "n_idle": len(idle),
              "p50_idle": float(np.median(idle)) if len(idle) else None,
              "arrival_s_from": "median of idle admissions" if len(idle) else
              "smallest admission lag (no admission found the loop idle)"}
    return lag, report


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.served_steps:
        name = args.name or f"{args.model}-served"
        model = calibrate_served(args.served_steps, name, args.skip_steps, args.form)
    else:
        from servelm.config import engine_args_from_cli
        from servelm.engine_builder import build_engine

        engine = build_engine(engine_args_from_cli(args))
        name = args.name or f"{engine.model_name}-{engine.engine_args.dtype}"
        model = calibrate(engine, name, progress=not args.no_progress, form=args.form)
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"cost-model-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    fit = model.fit
    print(json.dumps({"form": model.form, **{k: getattr(model, k) for k in
                                             (*ROOFLINE_FEATURES, "arrival_s")}}, indent=2))
    print(f"[calibrate] {model.form} form, {fit['num_samples']} steps; mean |error| "
          f"{fit['mean_abs_rel_error']:.1%}, p90 {fit['p90_abs_rel_error']:.1%}; wrote {out}",
          file=sys.stderr)
    for kind, row in fit["by_class"].items():
        print(f"[calibrate]   {kind}: {row['n']} steps, error p50 {row['error_p50']:+.1%}, "
              f"mean |error| {row['mean_abs_error']:.1%}, total predicted / measured "
              f"{row['total_ratio']:.3f}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- host bandwidths


class Transfer(NamedTuple):
    num_bytes: int
    seconds: float  # the fastest of the repeats
    method: str

    @property
    def bandwidth_Bps(self) -> float:
        return self.num_bytes / self.seconds


def _fastest(run: Callable[[], int], repeats: int,
             clock: Callable[[], float]) -> tuple[int, float]:
    """Bytes moved by one call of `run` and its fastest time over `repeats` calls (the
    achievable rate; slower repeats are other processes on a shared machine)."""
    best, moved = float("inf"), 0
    for _ in range(repeats):
        start = clock()
        moved = run()
        best = min(best, clock() - start)
    if best <= 0:
        raise RuntimeError("the clock did not advance; use a larger --sample-mb")
    return moved, best


def measure_memory_copy(num_bytes: int, repeats: int = 5,
                        clock: Callable[[], float] = time.perf_counter) -> Transfer:
    """One thread copying a buffer to another: bytes copied per second (each byte is read
    once and written once). Both buffers are touched first so no page fault is timed."""
    import numpy as np

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.zeros(num_bytes, dtype=np.uint8)

    def run() -> int:
        np.copyto(dst, src)
        return num_bytes

    moved, best = _fastest(run, repeats, clock)
    return Transfer(moved, best, "numpy copyto, one thread")


def _write_sample(path: Path, num_bytes: int) -> None:
    chunk = os.urandom(min(num_bytes, 1 << 24))
    with open(path, "wb") as f:
        left = num_bytes
        while left > 0:
            left -= f.write(chunk[:left])
        f.flush()
        os.fsync(f.fileno())


def _read_all(path: Path, flags: int, buf: mmap.mmap) -> int:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
        return total
    finally:
        os.close(fd)


def measure_disk_read(directory: str | Path, num_bytes: int, repeats: int = 2,
                      clock: Callable[[], float] = time.perf_counter) -> Transfer:
    """Sequential read of a file written for the purpose in `directory` (put it on the disk
    the weights load from). O_DIRECT bypasses the page cache; where the file system refuses
    it, the file's cached pages are dropped (posix_fadvise DONTNEED) before each read."""
    path = Path(directory) / f".servelm-calibrate-{os.getpid()}.bin"
    num_bytes = max(num_bytes - num_bytes % 4096, 4096)  # whole blocks, as O_DIRECT reads
    buf = mmap.mmap(-1, 1 << 24)  # page-aligned, as O_DIRECT needs
    try:
        _write_sample(path, num_bytes)
        try:
            moved, best = _fastest(lambda: _read_all(path, os.O_DIRECT, buf), repeats, clock)
            return Transfer(moved, best, f"O_DIRECT read of {path}")
        except (OSError, AttributeError):  # no O_DIRECT here (tmpfs, macOS)
            def run() -> int:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                return _read_all(path, 0, buf)
            moved, best = _fastest(run, repeats, clock)
            return Transfer(moved, best, f"read of {path} after dropping its cached pages")
    finally:
        buf.close()
        path.unlink(missing_ok=True)


def measure_host_to_gpu(num_bytes: int, repeats: int = 5) -> Transfer | None:
    """Pinned host memory -> GPU 0 over its host link; None without a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up: the first copy sets up the DMA path
    torch.cuda.synchronize()

    def run() -> int:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return num_bytes

    moved, best = _fastest(run, repeats, time.perf_counter)
    return Transfer(moved, best, f"pinned copy to {torch.cuda.get_device_name(0)}")


def host_calibration(disk_dir: str | Path, num_bytes: int, progress: bool = True
                     ) -> dict[str, float]:
    """The planner's calibration keys this machine can measure, in bytes/s."""
    measured = {"host_memory_bandwidth_Bps": measure_memory_copy(num_bytes),
                "disk_bandwidth_Bps": measure_disk_read(disk_dir, num_bytes),
                "host_link_bandwidth_Bps": measure_host_to_gpu(num_bytes)}
    out = {}
    for key, t in measured.items():
        if t is None:
            if progress:
                print(f"[calibrate] {key}: not measured (no CUDA GPU)", file=sys.stderr)
            continue
        out[key] = t.bandwidth_Bps
        if progress:
            print(f"[calibrate] {key}: {t.bandwidth_Bps / 1e9:.2f} GB/s "
                  f"({t.num_bytes / 1e6:.0f} MB in {t.seconds * 1e3:.1f} ms, {t.method})",
                  file=sys.stderr)
    return out


def merge_calibration(path: Path, measured: dict[str, float], source: str) -> dict:
    """The planner calibration file at `path` (if any) with `measured` keys replaced, so one
    file can hold MFUs from a step benchmark and the host's bandwidths."""
    data = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(data, dict):
        raise TypeError(f"{path} is not a JSON object")
    data.update(measured)
    data["source"] = source
    return data


def cmd_calibrate_host(args: argparse.Namespace) -> int:
    from servelm.bench.results import machine_info

    if args.sample_mb <= 0:
        raise SystemExit("--sample-mb: must be positive")
    if not Path(args.disk_dir).is_dir():
        raise SystemExit(f"--disk-dir: no such directory: {args.disk_dir}")
    measured = host_calibration(args.disk_dir, int(args.sample_mb * 1e6),
                                progress=not args.no_progress)
    out = Path(args.out) if args.out else Path("benchmarks/results/planner-calibration.json")
    cpu = machine_info().get("cpu", "this machine")
    source = (f"servelm bench calibrate --host, {cpu}, "
              f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    data = merge_calibration(out, measured, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    print(f"[calibrate] wrote {out}; use it with `servelm plan ... --calibration {out}`",
          file=sys.stderr)
    return 0


def _cmd(args: argparse.Namespace) -> int:
    return cmd_calibrate_host(args) if args.host else cmd_calibrate(args)


def add_parser(bench_sub) -> argparse.ArgumentParser:
    from servelm.config import add_engine_cli_args
    from servelm.loader.model_cache import DEFAULT_MODEL

    p = bench_sub.add_parser("calibrate", help="fit a step-cost model for `servelm sim` from "
                             "steps measured on this machine",
                             description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--name", default=None, help="the model's name (default: MODEL-DTYPE)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/cost-model-NAME.json)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--served-steps", nargs="+", default=None, metavar="TRACE",
                   help="fit to the steps a server recorded (`servelm serve --step-trace "
                        "TRACE`) instead of running steps in a lone engine: served steps also "
                        "pay for scheduling, detokenizing, streaming and the front end; the "
                        "model's arrival_s is the admission lag of the requests that found "
                        "the engine loop idle")
    p.add_argument("--form", choices=FORMS, default="roofline",
                   help="the model's form (servelm/engine/step_cost_model.py): roofline, the "
                        "default, is base + max(memory, compute), a step with a prefill chunk "
                        "costing its compute with its decode rows riding in it; linear sums every "
                        "part (the form of files written before there was a choice)")
    p.add_argument("--skip-steps", type=int, default=8,
                   help="with --served-steps: warm-up steps dropped from each trace (default 8)")
    g = p.add_argument_group("host bandwidths for `servelm plan --calibration` (--host)")
    g.add_argument("--host", action="store_true",
                   help="measure host DRAM copy, disk read and (with a GPU) pinned host-to-GPU "
                        "bandwidth instead of fitting a step-cost model; merged into --out "
                        "(default benchmarks/results/planner-calibration.json)")
    g.add_argument("--disk-dir", default=".",
                   help="where the disk sample is written and read (default: the current "
                        "directory; put it on the disk the weights load from)")
    g.add_argument("--sample-mb", type=float, default=256.0,
                   help="bytes per measurement, decimal MB (default 256)")
    add_engine_cli_args(p)
    p.set_defaults(func=_cmd)
    return p
