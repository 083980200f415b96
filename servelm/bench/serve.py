"""`servelm bench serve`: drive an OpenAI-compatible endpoint; TTFT, TPOT, goodput, curve.

Owns: the `bench serve` flags, building the seeded workload (shared with `bench offline`),
one measured run (run_serve) and the rate sweep, the result JSON and the readable table.
Never: starts or configures the server under test; sends traffic anywhere but --base-url.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from servelm.bench.loadgen import ARRIVALS, EndpointConfig, LoadSpec, run_load
from servelm.bench.metrics import build_serve_result, render_serve_table
from servelm.slo import goodput_by_class
from servelm.bench.results import SCHEMA_VERSION, git_commit, machine_info
from servelm.bench.vocab import workload_vocab_size
from servelm.bench.workloads import (RangeError, Request, conversation, documents,
                                     format_range, parse_range, random_lengths)
from servelm.loader.model_cache import DEFAULT_MODEL

DEFAULT_RESULTS_DIR = Path("benchmarks/results")
WORKLOADS = ("random", "conversation", "documents")
# Per workload: (input_len, output_len, num_prompts) when the flags are not given.
WORKLOAD_DEFAULTS = {"random": ("32:256", "128", 200),
                     "conversation": ("16:1024", "16:512", 200),
                     "documents": ("1000:2000", "128", 100)}
WARMUP_SEED_OFFSET = 10_000  # warm-up prompts differ from the measured ones (no cache help)
# In --duration mode, prompts generated per second of offered load (and a floor).
DURATION_HEADROOM = 1.5


class FlagError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def build_workload(kind: str, num_prompts: int, input_len: str, output_len: str,
                   vocab_size: int, seed: int) -> list[Request]:
    makers = {"random": random_lengths, "conversation": conversation, "documents": documents}
    if kind not in makers:
        raise FlagError("--workload", f"expected one of {', '.join(WORKLOADS)}, got {kind!r}")
    try:
        return makers[kind](num_prompts, parse_range(input_len, "--input-len"),
                            parse_range(output_len, "--output-len"), vocab_size, seed)
    except RangeError as e:
        flag = e.param if e.param.startswith("--") else "--" + e.param.replace("_", "-")
        raise FlagError(flag, str(e)) from None


def slo_workload(args: argparse.Namespace) -> list[Request] | None:
    """--slo-spec / --class-mix: the requests `servelm sim` simulates for the same flags, each
    carrying its class (None without --class-mix). Sets args.slo (the spec, or None)."""
    from servelm.bench.class_workload import class_workload
    from servelm.slo import SLOSpecError, parse_class_lengths, parse_class_mix, spec_from_flags

    try:
        args.slo = spec_from_flags(args.slo_spec, None, None) if args.slo_spec else None
    except SLOSpecError as e:
        raise FlagError("--slo-spec", str(e)) from None
    if args.class_mix is None:
        if args.class_len:
            raise FlagError("--class-len", "only with --class-mix")
        return None
    if args.slo is None:
        raise FlagError("--class-mix", "needs --slo-spec (the classes it names)")
    if args.workload != "random":
        raise FlagError("--class-mix", "draws random-length requests: --workload random")
    try:
        mix = parse_class_mix(args.class_mix, args.slo)
        lengths = parse_class_lengths(args.class_len, args.slo)
        reqs, classes = class_workload(args.num_prompts, mix, lengths, args.input_len,
                                       args.output_len, args.vocab_size, args.seed)
    except RangeError as e:
        raise FlagError("--class-len", str(e)) from None
    except ValueError as e:
        flag = str(e).split(":", 1)[0]
        raise FlagError(flag if flag.startswith("--") else "--class-mix",
                        str(e).split(": ", 1)[-1]) from None
    return [ClassRequest(r.prompt_token_ids, r.max_tokens, c) for r, c in zip(reqs, classes)]


class ClassRequest(NamedTuple):
    """A workload Request with its SLO class, sent as the body's `slo_class`."""

    prompt_token_ids: list[int]
    max_tokens: int
    slo_class: str


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise FlagError("--sweep-rates", f"expected comma-separated numbers, got {text!r}") \
            from None
    if not rates or any(not 0 < r < math.inf for r in rates):
        raise FlagError("--sweep-rates", f"rates must be positive and finite, got {text!r}")
    return sorted(set(rates))


def _resolve_defaults(args: argparse.Namespace) -> None:
    in_len, out_len, num = WORKLOAD_DEFAULTS[args.workload]
    args.input_len = args.input_len or in_len
    args.output_len = args.output_len or out_len
    args.rates = parse_rates(args.sweep_rates) if args.sweep_rates else None
    if args.request_rate is None and args.concurrency is None and not args.sweep_rates:
        if args.workload != "documents":
            raise FlagError("--request-rate", "give --request-rate, --concurrency or "
                                              "--sweep-rates")
        args.request_rate = math.inf  # a document batch is submitted all at once
    if args.num_prompts is None:
        if args.duration is None:
            args.num_prompts = num
        elif args.concurrency is not None:
            args.num_prompts = 4096
        else:
            top = max(args.rates) if args.rates else args.request_rate
            args.num_prompts = 4096 if math.isinf(top) else \
                max(16, math.ceil(top * args.duration * DURATION_HEADROOM))
    if args.num_prompts < 1:
        raise FlagError("--num-prompts", f"must be >= 1, got {args.num_prompts}")
    for flag in ("request_rate", "duration", "timeout"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise FlagError("--" + flag.replace("_", "-"), f"must be positive, got {value}")
    for flag in ("concurrency", "max_concurrency", "burst_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise FlagError("--" + flag.replace("_", "-"), f"must be >= 1, got {value}")
    if args.warmup < 0:
        raise FlagError("--warmup", f"must be >= 0, got {args.warmup}")
    if not 0 < args.goodput_target <= 1:
        raise FlagError("--goodput-target", f"must be in (0, 1], got {args.goodput_target}")
    if getattr(args, "record_requests", None) and args.sweep_rates:
        raise FlagError("--record-requests", "records one run: give --request-rate or "
                                             "--concurrency, not --sweep-rates")
    try:  # last: the other flags are checked without reading the model's config
        args.vocab_size = workload_vocab_size(args.model, args.vocab_size)
    except RangeError as e:
        raise FlagError(e.param, str(e)) from None


def endpoint_from_args(args: argparse.Namespace) -> EndpointConfig:
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        raise FlagError("--extra-body", f"not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise FlagError("--extra-body", "must be a JSON object")
    if args.endpoint == "chat" and args.prompt_format == "ids":
        args.prompt_format = "text"  # chat messages are text
    return EndpointConfig(base_url=args.base_url, model=args.model,
                          api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
                          endpoint=args.endpoint, prompt_format=args.prompt_format,
                          ignore_eos=args.ignore_eos, timeout_s=args.timeout, extra_body=extra)


def workload_info(args: argparse.Namespace, requests: Sequence[Request]) -> dict[str, Any]:
    return {"kind": args.workload, "num_prompts": len(requests),
            "input_len": format_range(parse_range(args.input_len)),
            "output_len": format_range(parse_range(args.output_len)),
            "seed": args.seed, "vocab_size": args.vocab_size,
            "prompt_format": args.prompt_format, "endpoint": args.endpoint,
            "num_input_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "num_output_tokens": sum(r.max_tokens for r in requests)}


def load_spec(args: argparse.Namespace, rate: float | None) -> LoadSpec:
    return LoadSpec(request_rate=rate if args.concurrency is None else None,
                    concurrency=args.concurrency, arrival=args.arrival,
                    burst_size=args.burst_size, duration_s=args.duration,
                    max_concurrency=args.max_concurrency, seed=args.seed)


def server_info(cfg: EndpointConfig) -> dict[str, Any]:
    """What the server says it is (/version, /v1/models), best effort: not every server has
    both, and a missing one must not stop the benchmark."""
    import httpx

    base = cfg.base_url.rstrip("/").removesuffix("/v1")
    info: dict[str, Any] = {}
    with httpx.Client(timeout=5.0, headers=cfg.headers(), trust_env=False) as client:
        for key, path in (("version", "/version"), ("models", "/v1/models")):
            try:
                resp = client.get(base + path)
                if resp.status_code == 200:
                    info[key] = resp.json()
            except (httpx.HTTPError, ValueError):
                pass
        try:  # a servelm server's start-up stages (servelm/startup.py), from /metrics
            resp = client.get(base + "/metrics")
            if resp.status_code == 200:
                from servelm.bench.coldstart import parse_stages

                stages, ready = parse_stages(resp.text)
                if ready is not None:
                    info["startup"] = {"ready_s": ready, "stages_s": stages}
        except httpx.HTTPError:
            pass
    if isinstance(info.get("models"), dict):  # keep the ids, not every field
        info["models"] = [m.get("id") for m in info["models"].get("data", [])
                          if isinstance(m, dict)]
    return info


def run_serve(args: argparse.Namespace, cfg: EndpointConfig, requests: Sequence[Request],
              rate: float | None, warmup: Sequence[Request]) -> dict[str, Any]:
    """One measured run at `rate` (or at --concurrency): the result dict."""
    spec = load_spec(args, rate)
    started = datetime.datetime.now(datetime.timezone.utc)
    load = run_load(cfg, requests, spec, warmup=warmup, progress=args.progress)
    slo_ttft = None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3
    slo_tpot = None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3
    measured = build_serve_result(load.records, load.elapsed_s, slo_ttft_s=slo_ttft,
                                  slo_tpot_s=slo_tpot, loop_lag_s=load.loop_lag_s)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "serve", "system": args.label,
        "model": cfg.model,
        "base_url": cfg.base_url, "server": server_info(cfg), "command": _command(),
        "machine": machine_info(), "commit": git_commit(),
        "started_at": started.isoformat(timespec="seconds"),
        "load": {"request_rate": spec.request_rate, "concurrency": spec.concurrency,
                 "arrival": spec.arrival if spec.request_rate is not None else "closed-loop",
                 "burst_size": spec.burst_size if spec.arrival == "burst" else None,
                 "duration_s": spec.duration_s, "max_concurrency": spec.max_concurrency,
                 "num_warmup": len(warmup), "num_warmup_failed": load.num_warmup_failed},
        **measured,
    }
    if math.isinf(result["load"]["request_rate"] or 0):
        result["load"]["request_rate"] = "inf"  # JSON has no infinity
    if result["num_completed"] and result["num_without_usage"] == 0 \
            and result["num_output_tokens"] != result["num_expected_output_tokens"]:
        result["warning"] = (f"server produced {result['num_output_tokens']} output tokens, "
                             f"{result['num_expected_output_tokens']} were requested (does it "
                             f"honour ignore_eos / min_tokens?)")
    examples = [f"{r.error}: {r.error_detail}" for r in load.records if r.error][:5]
    if examples:
        result["failure_examples"] = examples
    if getattr(args, "record_requests", None):
        record_requests(args.record_requests, requests, load.records)
    if getattr(args, "slo", None) is not None:  # per SLO class (records follow requests)
        result["slo"] = {"spec": args.slo.to_dict(), "by_class": goodput_by_class(
            args.slo, load.records, [getattr(r, "slo_class", None) or args.slo.default_class
                                     for r in requests])}
    return result


def record_requests(path: str, requests: Sequence[Request], records) -> None:
    """One JSON line per measured request, in send order: the trace `servelm sim --trace`
    replays (format: servelm/bench/request_trace.py). Records follow the requests in order (both
    load loops send requests[i] as the i-th record); times are from the first send. Where
    the server counted another prompt length (a text or chat prompt, which it tokenized
    itself), the line keeps the server's count and not the workload's ids."""
    from servelm.bench.request_trace import trace_line

    origin = min((r.scheduled_time for r in records), default=0.0)
    lines = []
    for req, rec in zip(requests, records):
        measured = {"ttft_s": rec.ttft_s, "tpot_s": rec.tpot_s, "e2e_s": rec.e2e_s,
                    "error": rec.error}
        ids = req.prompt_token_ids
        served = rec.usage_prompt_tokens
        if served is not None and served != len(ids):
            ids = None
        lines.append(trace_line(rec.scheduled_time - origin, ids, req.max_tokens,
                                rec.num_output_tokens if rec.is_ok else 0, measured,
                                num_prompt_tokens=served))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines))


def _command() -> str:
    rest = sys.argv[1:]
    if rest and rest[0] == "bench":
        rest = rest[1:]
    return " ".join(["servelm", "bench"] + rest)


def default_out_path(prefix: str) -> Path:
    now = datetime.datetime.now(datetime.timezone.utc)
    return DEFAULT_RESULTS_DIR / f"{prefix}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"


def _title(args: argparse.Namespace, info: dict[str, Any]) -> str:
    size = f"{args.duration:g} s" if args.duration else f"{info['num_prompts']} prompts"
    who = f"{args.label}: " if args.label else ""
    return (f"{who}{args.model} at {args.base_url}: {info['kind']} workload, {size}"
            f"{' per rate' if args.sweep_rates else ''}, input {info['input_len']}, "
            f"output {info['output_len']} tokens, "
            + (f"concurrency {args.concurrency}" if args.concurrency is not None
               else f"{args.arrival} arrivals") + f"; SLO TTFT {args.slo_ttft_ms:g} ms, "
            f"TPOT {args.slo_tpot_ms:g} ms")


def run_sweep(args, cfg, requests, warmup) -> dict[str, Any]:
    from servelm.bench.sweep import summarize_sweep

    runs = []
    for i, rate in enumerate(args.rates):
        print(f"[bench serve] rate {rate:g} req/s", file=sys.stderr)
        runs.append(run_serve(args, cfg, requests, rate, warmup if i == 0 else ()))
    summary = summarize_sweep(runs, args.goodput_target)
    return {"schema_version": SCHEMA_VERSION, "kind": "serve_sweep", "system": args.label,
            "model": cfg.model,
            "base_url": cfg.base_url, "command": _command(), "machine": machine_info(),
            "commit": git_commit(), "summary": summary, "runs": runs}


def cmd_serve(args: argparse.Namespace) -> int:
    from servelm.bench.sweep import plot_sweep, render_sweep_table

    try:
        _resolve_defaults(args)
        cfg = endpoint_from_args(args)
        requests = slo_workload(args)
        if requests is None:
            requests = build_workload(args.workload, args.num_prompts, args.input_len,
                                      args.output_len, args.vocab_size, args.seed)
        warmup = build_workload(args.workload, args.warmup, args.input_len, args.output_len,
                                args.vocab_size, args.seed + WARMUP_SEED_OFFSET) \
            if args.warmup else []
    except FlagError as e:
        print(f"servelm bench serve: error: {e}", file=sys.stderr)
        return 2
    info = workload_info(args, requests)
    try:
        if args.sweep_rates:
            result = run_sweep(args, cfg, requests, warmup)
        else:
            result = run_serve(args, cfg, requests, args.request_rate, warmup)
    except ConnectionError as e:
        print(f"servelm bench serve: error: {e}", file=sys.stderr)
        return 1
    result["workload"] = info
    for run in result.get("runs", []):
        run["workload"] = info
    out = Path(args.out) if args.out else default_out_path(
        "serve-sweep" if args.sweep_rates else "serve")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(_title(args, info))
    if args.sweep_rates:
        png = plot_sweep(result["summary"], out.with_suffix(".png"), _title(args, info),
                         args.slo_ttft_ms, args.slo_tpot_ms)
        print(render_sweep_table(result["summary"]))
        print(f"[bench serve] wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
        return 0 if result["summary"]["points"] else 1
    print(render_serve_table(result))
    if result.get("warning"):
        print(f"warning: {result['warning']}")
    print(f"[bench serve] wrote {out}", file=sys.stderr)
    return 0 if result["num_completed"] else 1


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `serve` under `servelm bench` (called from servelm/bench/cli.py)."""
    p = bench_sub.add_parser(
        "serve", help="drive an OpenAI-compatible server: TTFT/TPOT percentiles, goodput, "
                      "throughput-latency curve", description=__doc__.splitlines()[0])
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=DEFAULT_MODEL, help="the `model` field sent")
    g.add_argument("--label", default=None,
                   help="the system's name in the result (`system`), e.g. vllm; "
                        "`bench compare` groups results by it")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="prompt as token ids (servelm, vLLM, llama.cpp) or as words made "
                        "from them (any server; chat is always text)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (servers that reject them)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("load")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--request-rate", type=float, default=None,
                      help="open loop: mean requests/s ('inf': all at once)")
    mode.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: this many requests always in flight")
    mode.add_argument("--sweep-rates", default=None,
                      help="r1,r2,...: one run per rate; the curve PNG next to --out")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    g.add_argument("--burst-size", type=int, default=8, help="requests per burst")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: at most this many in flight (later ones wait, counted)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests (default by workload: 200, documents 100)")
    g.add_argument("--duration", type=float, default=None,
                   help="stop sending after this many seconds (in-flight ones finish)")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--input-len", default=None,
                   help="prompt tokens A or A:B (default by workload)")
    g.add_argument("--output-len", default=None, help="output tokens A or A:B")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn from [100, vocab-size - 100) (default: "
                        "--model's vocabulary, from its config: a registry name or a path "
                        "this machine can read)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=200.0)
    g.add_argument("--goodput-target", type=float, default=0.9)
    g.add_argument("--slo-spec", default=None, metavar="FILE",
                   help="the SLO spec (JSON, docs/slo.md) the server reads: goodput per "
                        "class in the result (`slo.by_class`)")
    g.add_argument("--class-mix", default=None, metavar="NAME=SHARE,...",
                   help="requests drawn from the spec's classes with these shares, each sent "
                        "with its slo_class (the same requests as `servelm sim --class-mix`)")
    g.add_argument("--class-len", action="append", default=None,
                   metavar="NAME=INPUT_LEN/OUTPUT_LEN",
                   help="a class's own prompt and output lengths (repeatable)")
    g.add_argument("--out", default=None,
                   help="result JSON (default benchmarks/results/serve-<UTC time>.json)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--record-requests", metavar="FILE", default=None,
                   help="also write one JSON line per request (send offset, prompt ids, "
                        "tokens asked for and received, TTFT/TPOT/e2e): a trace for "
                        "`servelm sim --trace`")
    p.set_defaults(func=cmd_serve)
    return p
