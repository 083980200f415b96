"""`servelm bench coldstart`: how long `servelm serve` takes to become useful, stage by stage.

Each run starts `servelm serve MODEL` on a free port (through the launcher, servelm/launch/)
and measures, from just before the process is created: the first 200 from /health
(`health_s`) and the first token of a one-token completion (`first_token_s`); it then reads
the server's own stages from /metrics (`servelm_startup_stage_seconds{stage}`,
servelm/startup.py, which sum to its `ready_s`) and stops the server. With --cold-first the
first run starts without this model's caches (the GGUF index and the prepared weights are
removed first), as on a machine that has not served it yet; the C++ kernels stay built (a
first build on a machine takes about a minute and is logged as the `kernels` stage). Writes
JSON and a PNG of the stages per run.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

from servelm.bench.results import SCHEMA_VERSION, git_commit, machine_info
from servelm.loader.model_cache import DEFAULT_MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clear_model_caches(model: str) -> list[str]:
    """Remove `model`'s GGUF index and its prepared-weights entries, one per dtype the server
    may run it in (--dtype auto picks per CPU); returns what was removed."""
    import torch

    from servelm.loader import load_model_config, prepared, resolve_model
    from servelm.loader.gguf_index import index_dir, index_key
    from servelm.models import get_model_class

    source = resolve_model(model)
    model_class = get_model_class(load_model_config(source).architecture)
    targets = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        key = prepared.prepared_key(source, model_class, dtype)
        if key is not None:
            targets.append(prepared.prepared_dir() / f"{key}.safetensors")
    if source.kind == "gguf":
        targets.append(index_dir() / f"{index_key(source.path)}.msgpack")
    removed = []
    for t in targets:
        if t.exists():
            t.unlink()
            removed.append(str(t))
    return removed


def parse_stages(metrics_text: str) -> tuple[dict[str, float], float | None]:
    stages, ready = {}, None
    for row in metrics_text.splitlines():
        if row.startswith("servelm_startup_stage_seconds{"):
            stages[row.split('"')[1]] = float(row.split()[-1])
        elif row.startswith("servelm_startup_ready_seconds "):
            ready = float(row.split()[-1])
    return stages, ready


def one_run(model: str, serve_args: list[str], timeout_s: float, cold: bool) -> dict:
    import httpx

    from servelm.launch import DEVNULL, HttpHealth, ProcessSpec, Resources, Supervisor

    removed = clear_model_caches(model) if cold else []
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "servelm.cli", "serve", model, "--port", str(port),
           "--no-log-requests", *serve_args]
    log: list[str] = []
    # /health probed every 10 ms, so health_s is the start-up's, not the poll's; the server's
    # stderr lines kept (the notes), SIGINT to stop it as Ctrl-C would
    spec = ProcessSpec(f"servelm serve {url}", tuple(cmd),
                       resources=Resources(env={"PYTHONUNBUFFERED": "1"}),
                       readiness=HttpHealth(url + "/health", probe_timeout_s=5.0),
                       ready_timeout_s=timeout_s, ready_poll_s=0.01, stdout=DEVNULL,
                       stderr=DEVNULL, on_stderr_line=log.append, stop_signal=signal.SIGINT)
    t0 = time.time()
    # LaunchError if it dies first (with its last stderr lines) or misses timeout_s
    handle = Supervisor(stop_at_exit=False).start(spec)
    health_s = time.time() - t0
    try:
        with httpx.Client(timeout=5.0) as client:
            served = client.get(url + "/v1/models").json()["data"][0]["id"]
            r = client.post(url + "/v1/completions", timeout=60.0,
                            json={"model": served, "prompt": "Hello", "max_tokens": 1})
            r.raise_for_status()
            first_token_s = time.time() - t0
            stages, ready = parse_stages(client.get(url + "/metrics").text)
    finally:
        handle.stop(grace_s=60.0)
    notes = [line.strip() for line in log if "start-up:" in line or "serving" in line]
    return {"cold": cold, "caches_removed": removed, "health_s": round(health_s, 4),
            "first_token_s": round(first_token_s, 4), "ready_s": ready, "stages_s": stages,
            "log": notes}


def summarize(runs: list[dict]) -> dict:
    warm = [r for r in runs if not r["cold"]]
    out = {}
    if warm:
        names = sorted({k for r in warm for k in r["stages_s"]})
        out["warm_median"] = {
            "health_s": round(statistics.median(r["health_s"] for r in warm), 4),
            "first_token_s": round(statistics.median(r["first_token_s"] for r in warm), 4),
            "ready_s": round(statistics.median(r["ready_s"] for r in warm), 4),
            "stages_s": {n: round(statistics.median(r["stages_s"].get(n, 0.0) for r in warm),
                                  4) for n in names},
        }
    cold = [r for r in runs if r["cold"]]
    if cold:
        out["cold"] = {k: cold[0][k] for k in ("health_s", "first_token_s", "ready_s",
                                               "stages_s")}
    return out


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servelm.startup import STAGES

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(runs) + 1.8))
    cmap = plt.get_cmap("tab20")
    labels = [f"run {i + 1}{' (cold)' if r['cold'] else ''}" for i, r in enumerate(runs)]
    for i, r in enumerate(runs):
        left = 0.0
        for j, name in enumerate(STAGES):
            w = r["stages_s"].get(name, 0.0)
            if w <= 0:
                continue
            ax.barh(i, w, left=left, color=cmap(j % 20),
                    label=name if name not in ax.get_legend_handles_labels()[1] else None)
            left += w
        ax.plot([r["health_s"]], [i], "k|", markersize=18)
    ax.set_yticks(range(len(runs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start (| = first /health 200 seen by the client)")
    ax.set_title(f"servelm serve {result['model']}: start-up stages", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def cmd_coldstart(args: argparse.Namespace) -> int:
    serve_args = list(args.serve_arg or [])
    runs = []
    total = args.runs + (1 if args.cold_first else 0)
    for i in range(total):
        cold = args.cold_first and i == 0
        r = one_run(args.model, serve_args, args.timeout, cold)
        runs.append(r)
        print(f"[bench coldstart] run {i + 1}/{total}{' (cold caches)' if cold else ''}: "
              f"/health {r['health_s']:.2f} s, first token {r['first_token_s']:.2f} s, server "
              f"ready {r['ready_s']:.2f} s", file=sys.stderr, flush=True)
    result = {"schema_version": SCHEMA_VERSION, "kind": "coldstart", "model": args.model,
              "command": " ".join(["servelm", "bench", "coldstart",
                                   *sys.argv[sys.argv.index("coldstart") + 1:]]
                                  if "coldstart" in sys.argv else sys.argv),
              "serve_args": serve_args, "machine": machine_info(), "commit": git_commit(),
              "runs": runs, **summarize(runs)}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out or f"benchmarks/results/coldstart-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(result, png)
    print(f"[bench coldstart] wrote {out} and {png}", file=sys.stderr)
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `coldstart` under `servelm bench` (called from servelm/bench/cli.py)."""
    p = bench_sub.add_parser("coldstart", help="start `servelm serve` N times: /health, first "
                                               "token and the server's stages",
                             description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="cached model name, .gguf file or HF directory")
    p.add_argument("--runs", type=int, default=3, help="warm runs (default %(default)s)")
    p.add_argument("--cold-first", action=argparse.BooleanOptionalAction, default=True,
                   help="one more run first, without this model's index and prepared weights")
    p.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="a flag for `servelm serve` (repeatable, e.g. --serve-arg=--threads=2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    p.add_argument("--out", default=None,
                   help="result JSON (default benchmarks/results/coldstart-<UTC time>.json)")
    p.set_defaults(func=cmd_coldstart)
    return p
