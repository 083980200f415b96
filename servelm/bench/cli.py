"""`servelm bench offline`: servelm and peer systems side by side on one seeded workload.

Owns: the `bench` sub-command, running the systems one after another (never two at once, so
they never share cores), the side-by-side table, the result JSON and its bar chart.
Never: measures inside a peer's process (peers.py does, in the peer's own venv).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from servelm.bench.results import render_table
from servelm.bench.vocab import workload_vocab_size
from servelm.bench.workloads import (RangeError, Request, format_range, parse_range,
                                     random_lengths, shared_prefix)
from servelm.launch import DEVNULL, ProcessSpec, Resources, Supervisor
from servelm.loader.model_cache import DEFAULT_MODEL

PEERS = ("llama.cpp", "llama-server", "vllm", "vllm-bf16", "hf")
# A peer name that is another's backend with fixed flags: vLLM's bf16 path (its best on a CPU
# with bf16 math) next to its float32 one in the same run. It takes the base peer's
# interpreter and model unless given its own.
PEER_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "vllm-bf16": ("vllm", ["--dtype", "bfloat16"])}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PEERS_SCRIPT = Path(__file__).with_name("peers.py")
DEFAULT_RESULTS_DIR = Path("benchmarks/results")


class FlagError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


def parse_mapping(text: str | None, flag: str) -> dict[str, str]:
    """"llama.cpp=/a/python,vllm=/b/python" -> {"llama.cpp": "/a/python", ...}"""
    mapping: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise FlagError(flag, f"expected NAME=VALUE[,NAME=VALUE...], got {item!r}")
        if name.strip() not in PEERS:
            raise FlagError(flag, f"unknown peer {name.strip()!r}; known: {', '.join(PEERS)}")
        mapping[name.strip()] = value.strip()
    return mapping


def parse_peers(text: str | None) -> list[str]:
    names = [p.strip() for p in (text or "").split(",") if p.strip()]
    for name in names:
        if name not in PEERS:
            raise FlagError("--peers", f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def workload_from_args(args: argparse.Namespace) -> list[Request]:
    try:
        if args.workload == "shared-prefix":
            return shared_prefix(args.num_prompts, args.prefix_len, args.suffix_len,
                                 parse_range(args.output_len, "--output-len"), args.vocab_size,
                                 args.seed)
        return random_lengths(args.num_prompts, parse_range(args.input_len, "--input-len"),
                              parse_range(args.output_len, "--output-len"), args.vocab_size,
                              args.seed)
    except RangeError as e:
        flag = e.param if e.param.startswith("--") else _flag(e.param)
        raise FlagError(flag, str(e)) from None


def workload_info(args: argparse.Namespace, requests: list[Request]) -> dict[str, Any]:
    if args.workload == "shared-prefix":
        input_len = f"{args.prefix_len} shared + {args.suffix_len} unique"
    else:
        input_len = format_range(parse_range(args.input_len))
    return {"kind": args.workload.replace("-", "_"), "num_prompts": args.num_prompts,
            "input_len": input_len,
            "output_len": format_range(parse_range(args.output_len)),
            "seed": args.seed, "vocab_size": args.vocab_size,
            "num_input_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "num_output_tokens": sum(r.max_tokens for r in requests)}


def default_out_path(now: datetime.datetime | None = None) -> Path:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return DEFAULT_RESULTS_DIR / f"offline-{now.strftime('%Y%m%dT%H%M%SZ')}.json"


# --- running the systems -----------------------------------------------------------------


def run_servelm(args: argparse.Namespace, requests: list[Request]) -> dict[str, Any]:
    from servelm.bench.offline import run_offline
    from servelm.config import EngineArgs

    import dataclasses

    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    engine_kwargs = {k: v for k, v in vars(args).items() if k in names}
    print(f"[bench] servelm: {args.model}", file=sys.stderr)
    return run_offline(args.model, requests, engine_kwargs, threads=args.num_threads,
                       seed=args.seed, vocab_size=args.vocab_size, progress=args.progress,
                       command=_servelm_command())


def _servelm_command() -> list[str]:
    rest = sys.argv[1:]
    if rest and rest[0] == "bench":  # run as `servelm bench ...` rather than `-m ...cli`
        rest = rest[1:]
    return ["servelm", "bench"] + rest


def peer_backend(peer: str) -> str:
    return PEER_VARIANTS.get(peer, (peer, []))[0]


def peer_command(args: argparse.Namespace, peer: str, python: str, model: str,
                 workload_path: str, out_path: str) -> list[str]:
    backend, fixed = PEER_VARIANTS.get(peer, (peer, []))
    cmd = [python, str(PEERS_SCRIPT), "--backend", backend, "--label", peer, "--model", model,
           "--workload", workload_path, "--seed", str(args.seed),
           "--vocab-size", str(args.vocab_size), "--threads", str(args.num_threads),
           "--max-num-seqs", str(args.max_num_seqs), "--out", out_path]
    if backend in ("vllm", "hf") and not fixed:
        # servelm's float type when --dtype names one (a choice such as "auto" is servelm's
        # own, resolved inside the engine): float32, the dequantized model's, otherwise
        dtype = getattr(args, "dtype", None)
        cmd += ["--dtype", dtype if dtype in FLOAT_DTYPES else "float32"]
    cmd += fixed
    if backend == "llama-server":
        binary = parse_mapping(getattr(args, "peer_bin", ""), "--peer-bin").get(peer)
        if not binary:
            raise FlagError("--peer-bin", f"no binary given for {peer}")
        cmd += ["--server-bin", binary]
    if not args.progress:
        cmd.append("--no-progress")
    return cmd


def peer_spec(peer: str, cmd: list[str]) -> ProcessSpec:
    """A peer's benchmark run: its stderr (progress bars) forwarded as it comes, the last
    lines kept for the error; the environment a user would run it in, without servelm's own
    defaults (servelm/own_env.py)."""
    from servelm.own_env import OWN_ENV

    return ProcessSpec(f"peer {peer}", tuple(cmd), stdout=DEVNULL,
                       resources=Resources(unset_env=tuple(OWN_ENV)))


def run_peer(args: argparse.Namespace, peer: str, python: str, model: str,
             workload_path: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="servelm-bench-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        cmd = peer_command(args, peer, python, model, workload_path, out_path)
        print(f"[bench] {peer}: {' '.join(cmd)}", file=sys.stderr)
        supervisor = Supervisor(stop_at_exit=False)
        try:
            handle = supervisor.start(peer_spec(peer, cmd))
        except OSError as e:
            return {"system": peer, "model": model, "error": f"cannot start {python}: {e}"}
        death = handle.death(settle_s=args.peer_timeout)
        if death is None:
            handle.signal(signal.SIGKILL)
            handle.proc.wait()
            return {"system": peer, "model": model,
                    "error": f"timed out after {args.peer_timeout}s"}
        if death.returncode != 0 or not os.path.exists(out_path):
            reason = death.stderr_tail[-1] if death.stderr_tail else "no output"
            return {"system": peer, "model": model,
                    "error": f"exit {death.returncode}: {reason[:300]}"}
        with open(out_path) as f:
            return json.load(f)


def registry_gguf(model: str) -> str | None:
    """The GGUF file behind MODEL (a path, or a cached registry name), for llama.cpp."""
    if model.endswith(".gguf"):
        return model
    try:
        from servelm.loader.model_cache import cached_path
    except ImportError:
        return None
    path = cached_path(model)
    return str(path) if path is not None and path.suffix == ".gguf" else None


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    if getattr(args, "step_trace", None):  # an engine flag the offline runs cannot honour
        raise FlagError("--step-trace", "traces the steps of a serving engine's loop "
                        "(`servelm serve --step-trace FILE`); bench offline steps the engine "
                        "itself, so nothing would be written")
    peers = parse_peers(args.peers)
    pythons = parse_mapping(args.peer_python, "--peer-python")
    models = parse_mapping(args.peer_model, "--peer-model")
    bins = parse_mapping(getattr(args, "peer_bin", ""), "--peer-bin")
    pythons.setdefault("hf", sys.executable)
    pythons.setdefault("llama-server", sys.executable)  # its client needs the stdlib only
    gguf = registry_gguf(args.model)
    if gguf:
        models.setdefault("llama.cpp", gguf)
        models.setdefault("llama-server", gguf)
    for peer in peers:
        if peer_backend(peer) != peer:
            for mapping in (pythons, models):
                if peer_backend(peer) in mapping:
                    mapping.setdefault(peer, mapping[peer_backend(peer)])
        if peer not in pythons:
            raise FlagError("--peer-python", f"no interpreter given for {peer}")
        if peer not in models:
            raise FlagError("--peer-model", f"no model given for {peer}")
        if peer_backend(peer) == "llama-server" and peer not in bins:
            raise FlagError("--peer-bin", f"no binary given for {peer}")
    try:  # every system gets ids inside the model's vocabulary (the peers are told it too)
        args.vocab_size = workload_vocab_size(args.model, args.vocab_size)
    except RangeError as e:
        raise FlagError(e.param, str(e)) from None
    requests = workload_from_args(args)
    info = workload_info(args, requests)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="servelm-bench-") as tmp:
        workload_path = os.path.join(tmp, "workload.json")
        with open(workload_path, "w") as f:
            json.dump({**info, "requests": [r._asdict() for r in requests]}, f)
        variants = [("servelm", {})]
        if args.compare_prefix_cache:
            variants = [("servelm", {"enable_prefix_caching": True}),
                        ("servelm (no prefix cache)", {"enable_prefix_caching": False})]
        for name, overrides in variants if not args.no_servelm else []:
            try:
                result = run_servelm(argparse.Namespace(**{**vars(args), **overrides}),
                                     requests)
                result["system"] = name
            except Exception as e:  # a broken engine must not hide the peers' numbers
                result = {"system": name, "model": args.model,
                          "error": f"{type(e).__name__}: {e}"}
            results.append(result)
        for peer in peers:
            results.append(run_peer(args, peer, pythons[peer], models[peer], workload_path))
    for r in results:
        r["workload"] = info
    return results


# --- output ------------------------------------------------------------------------------


def plot(results: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Bar charts of the headline numbers, one panel per metric."""
    ok = [r for r in results if not r.get("error")]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servelm.bench.results import table_row

    rows = [table_row(r) for r in ok]
    panels = [("output_tok_s", "output tok/s"), ("total_tok_s", "total tok/s"),
              ("ttft_mean_ms", "TTFT mean (ms)"), ("decode_tok_s", "decode tok/s per stream"),
              ("peak_memory_mib", "peak memory (MiB)")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    names = [r["system"] for r in rows]
    colors = ["#d62728" if n == "servelm" else "#1f77b4" for n in names]
    for ax, (key, label) in zip(axes.flat, panels):
        values = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=9)
        ax.margins(y=0.15)
        for bar, value in zip(bars, values):
            text = f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 \
                else f"{value:.2f}"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
    notes = axes.flat[-1]
    notes.axis("off")
    failed = [r for r in results if r.get("error")]
    lines = [f"{r['system']}: {r.get('output_tok_s', 0):.1f} out tok/s" for r in rows]
    lines += [f"{r['system']}: FAILED" for r in failed]
    notes.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=9, family="monospace")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def title_of(results: list[dict[str, Any]]) -> str:
    info = results[0].get("workload", {})
    machine = next((r["machine"] for r in results if r.get("machine")), {})
    return (f"{info.get('num_prompts')} prompts, input {info.get('input_len')}, output "
            f"{info.get('output_len')} tokens; {machine.get('cpu', '?')}, "
            f"{machine.get('threads', '?')} threads")


def cmd_offline(args: argparse.Namespace) -> int:
    if args.num_threads is None:
        args.num_threads = os.cpu_count() or 1
    try:
        results = run_all(args)
    except FlagError as e:
        print(f"servelm bench offline: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    png = plot(results, out.with_suffix(".png"), title_of(results))
    print(title_of(results))
    print(render_table(results))
    print(f"[bench] wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0 if all(not r.get("error") for r in results) else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks (offline throughput and latency)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser(
        "offline", help="generate a seeded workload with servelm and peers; table, JSON, PNG",
        description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="cached model name, .gguf file or HF directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--workload", choices=["random", "shared-prefix"], default="random",
                   help="random: --input-len prompts; shared-prefix: --prefix-len common "
                   "tokens + --suffix-len unique ones per prompt")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=100)
    p.add_argument("--input-len", default="32:256", help="prompt tokens: A or A:B")
    p.add_argument("--output-len", default="128", help="new tokens (EOS ignored): A or A:B")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn from [100, vocab-size - 100) (default: "
                        "the model's vocabulary, from its config)")
    p.add_argument("--out", default=None, help="result JSON (default: "
                   "benchmarks/results/offline-<UTC time>.json); the PNG goes next to it")
    p.add_argument("--peers", default="", help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--peer-python", default="",
                   help="NAME=PYTHON,... interpreter of each peer's venv (hf: this one)")
    p.add_argument("--peer-model", default="",
                   help="NAME=PATH,... GGUF for llama.cpp, HF dir for vllm and hf")
    p.add_argument("--peer-bin", default="",
                   help="NAME=PATH,... a native peer's binary (llama-server)")
    p.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds per peer")
    p.add_argument("--no-servelm", action="store_true", help="run the peers only")
    p.add_argument("--compare-prefix-cache", action="store_true",
                   help="run servelm twice, with and without the prefix cache")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    try:
        from servelm.config import add_engine_cli_args
    except ImportError:  # the engine is optional for peer-only runs
        p.add_argument("--max-num-seqs", type=int, default=128)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--kv-cache-memory", type=int, default=None)
        p.add_argument("--threads", dest="num_threads", type=int, default=None)
    else:
        add_engine_cli_args(p)
    p.set_defaults(func=cmd_offline)
    from servelm.bench.serve import add_parser as add_serve_parser  # `bench serve`
    add_serve_parser(bench_sub)
    from servelm.bench.compare import add_parser as add_compare_parser  # `bench compare`
    add_compare_parser(bench_sub)
    from servelm.bench.spec import add_parser as add_spec_parser  # `bench spec`
    add_spec_parser(bench_sub)
    from servelm.bench.calibrate import add_parser as add_calibrate_parser  # `bench calibrate`
    add_calibrate_parser(bench_sub)
    from servelm.bench.multiturn import add_parser as add_multiturn_parser  # `bench multiturn`
    add_multiturn_parser(bench_sub)
    from servelm.bench.coldstart import add_parser as add_coldstart_parser  # `bench coldstart`
    add_coldstart_parser(bench_sub)
    from servelm.bench.batch_knee import add_parser as add_batch_knee_parser  # `bench batch-knee`
    add_batch_knee_parser(bench_sub)
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m servelm.bench.cli offline ...` (or `... bench offline ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv.insert(0, "bench")
    parser = argparse.ArgumentParser(prog="servelm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
