"""`servelm serve MODEL`: build the engine, then serve the OpenAI API with uvicorn.

Owns: the serve flags, logging of the per-request JSON lines, and SIGTERM/SIGINT handling:
the first signal drains (new requests get 503, in-flight ones finish for up to
--drain-timeout seconds, then the rest are aborted and the process exits 0); a second SIGINT
exits at once.
Never: imports FastAPI or torch before the command runs (the CLI's --help stays fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

from servelm import startup


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve MODEL over the OpenAI API (docs/server.md).")
    add_serve_args(p)
    p.set_defaults(func=handler)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serve flags (`servelm config show` takes them too); their defaults are
    ServerConfig's (servelm/server/server_config.py) and the engine's EngineArgs'
    (add_engine_cli_args). Each is also a key of a --config file (config_file.py)."""
    import dataclasses

    from servelm.config import add_engine_cli_args
    from servelm.loader.model_cache import DEFAULT_MODEL
    from servelm.planner.hardware import default_peaks
    from servelm.router.policies import DEFAULT_POLICY, policy_help, policy_names
    from servelm.server.server_config import ServerConfig

    d = {f.name: f.default for f in dataclasses.fields(ServerConfig)}.__getitem__
    (cpu_bw, cpu_flops), (gpu_bw, gpu_flops) = default_peaks("cpu"), default_peaks("cuda")

    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="cached model name, .gguf file, HF directory or Hugging Face name "
                        f"ORG/NAME[:QUANT][@REV] (default {DEFAULT_MODEL})")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="serve options from a YAML file: each flag's long name is a key, the "
                        "topology flags under `topology:`; flags given here override it "
                        "(`servelm config show` prints the result; docs/server.md)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the name clients use in `model` (default: the model's name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the "
                        "dashboard page "
                        "(default: $SERVELM_API_KEY)")
    g.add_argument("--max-n", type=int, default=d("max_n"), help="largest n accepted")
    g.add_argument("--max-queue", type=int, default=d("max_queue"),
                   help="waiting requests before new ones get 429")
    g.add_argument("--request-timeout", type=float, default=d("request_timeout"),
                   help="default per-request deadline in seconds (the `timeout` header "
                        "overrides it)")
    g.add_argument("--drain-timeout", type=float, default=d("drain_timeout"),
                   help="seconds in-flight requests may run after SIGTERM")
    g.add_argument("--slo-ttft-ms", type=float, default=d("slo_ttft_ms"))
    g.add_argument("--slo-tpot-ms", type=float, default=d("slo_tpot_ms"))
    g.add_argument("--slo-spec", default=d("slo_spec"), metavar="FILE",
                   help="SLO classes (JSON, docs/slo.md): the targets requests name with "
                        "`priority` / `slo_class`, the per-class goodput gauges and the slo "
                        "scheduling policy read it; replaces --slo-ttft-ms / --slo-tpot-ms")
    g.add_argument("--max-body-bytes", type=int, default=d("max_body_bytes"))
    g.add_argument("--write-timeout", type=float, default=d("write_timeout"),
                   help="seconds a stream reader may stall before it is dropped")
    g.add_argument("--peak-bandwidth", type=float, default=d("peak_bandwidth"),
                   help=f"bytes/s for bandwidth utilisation (default: {cpu_bw:g} on CPU, "
                        f"{gpu_bw:g} on CUDA)")
    g.add_argument("--peak-flops", type=float, default=d("peak_flops"),
                   help=f"FLOP/s for compute utilisation (default: {cpu_flops:g} on CPU, "
                        f"{gpu_flops:g} on CUDA)")
    # Limits (docs/server.md, "Limits").
    g.add_argument("--max-prompts", type=int, default=d("max_prompts"),
                   help="prompts in one completion request; more get a 400 naming `prompt` "
                        "(default %(default)s)")
    g.add_argument("--max-choices", type=int, default=d("max_choices"),
                   help="n x prompts in one request; more get a 400 naming `n` "
                        "(default %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d("header_timeout"),
                   help="seconds a connection may take to send a request line and headers "
                        "before it is closed (default %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=d("keep_alive_timeout"),
                   help="seconds an idle keep-alive connection stays open (default "
                        "%(default)s)")
    g.add_argument("--max-connections", type=int, default=d("max_connections"),
                   help="open connections; a connection beyond it gets a 503 and is closed "
                        "(default %(default)s)")
    g.add_argument("--max-image-bytes", type=int, default=d("max_image_bytes"),
                   help="vision models: the largest image (encoded bytes) a content part may "
                        "carry (default %(default)s)")
    g.add_argument("--max-image-pixels", type=int, default=d("max_image_pixels"),
                   help="vision models: the largest width x height of one image, checked "
                        "before decoding (default %(default)s)")
    g.add_argument("--max-images-per-request", type=int, default=d("max_images_per_request"))
    g.add_argument("--allowed-image-hosts", type=_host_list, default=d("allowed_image_hosts"),
                   metavar="HOST,...",
                   help="hosts whose https:// image URLs the server may fetch (default: none; "
                        "images come as data: URLs)")
    from servelm.parsers import REASONING_PARSERS, TOOL_PARSERS

    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   default=d("tool_call_parser"),
                   help="the format the model writes tool calls in, read into tool_calls "
                   "(tool_choice auto; docs/server.md)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   default=d("reasoning_parser"),
                   help="read <think> output into reasoning_content (default: none)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N replicas of the model (each its own front end and engine core, the "
                        "cores split between them) behind a router on this port")
    g.add_argument("--disagg", default=None, metavar="P:D",
                   help="prefill/decode disaggregation on this machine: P prefill and D decode "
                        "workers (the cores split between them) behind a router on this port "
                        "(docs/disaggregation.md)")
    g.add_argument("--router-policy", default=DEFAULT_POLICY, choices=policy_names(),
                   help="with --data-parallel-size or --backend ray: " + policy_help())
    r = p.add_argument_group("replicas on Ray")
    r.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: this machine's processes (default; --data-parallel-size N "
                        "replicas); ray: --num-replicas replicas as Ray actors on a cluster, "
                        "the router here (docs/router.md)")
    r.add_argument("--num-replicas", type=int, default=1, metavar="N",
                   help="with --backend ray: replicas to place")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --backend ray or --parallel-launcher ray: the cluster to join "
                        "(default $RAY_ADDRESS, a cluster started here with `ray start`, "
                        "else a local Ray instance)")
    r.add_argument("--replica-cpus", type=float, default=1.0, metavar="C",
                   help="with --backend ray: CPUs each replica actor holds (its --threads "
                        "unless given; default %(default)s)")
    r.add_argument("--replica-gpus", type=float, default=0.0, metavar="G",
                   help="with --backend ray: GPUs each replica actor holds (default "
                        "%(default)s)")
    r.add_argument("--autoscale", default=None, metavar="POLICY_FILE",
                   help="with --backend ray: add and remove replica actors as the load "
                        "asks, by this policy (JSON; docs/autoscale.md), starting from "
                        "--num-replicas within its min..max")
    g.add_argument("--engine-core", choices=("process", "thread"), default="process",
                   help="run the engine core (scheduler + model) in its own process "
                        "(default; a slow client or a busy event loop never delays a step) or "
                        "on a thread of the HTTP process")
    g.add_argument("--request-log", default=d("request_log"), metavar="FILE",
                   help="append each finished request's timing record (queue, prefill, "
                        "stalls, client) to FILE as JSON lines, for `servelm doctor --log`")
    g.add_argument("--otlp-traces-endpoint", default=d("otlp_traces_endpoint"), metavar="URL",
                   help="send OpenTelemetry spans per request (front end, queue, prefill, "
                        "decode, stream) to this OTLP/HTTP endpoint, e.g. "
                        "http://127.0.0.1:4318/v1/traces (needs servelm[otel]; default: off)")
    g.add_argument("--state-store", default=d("state_store"), metavar="URL",
                   help="where responses, files and batches are kept: sqlite:///PATH (a file "
                        "shared by the replicas of this machine; default "
                        "$SERVELM_HOME/state.sqlite3) or postgresql://USER@HOST/DB (replicas "
                        "on several machines; needs servelm[postgres])")
    g.add_argument("--max-file-bytes", type=int, default=d("max_file_bytes"),
                   help="largest file POST /v1/files takes (413 beyond)")
    g.add_argument("--max-batch-lines", type=int, default=d("max_batch_lines"),
                   help="requests in one batch's input file (the batch fails beyond)")
    g.add_argument("--max-active-batches", type=int, default=d("max_active_batches"),
                   help="batches not yet finished in the state store (429 beyond)")
    for flag, what in (("files", "uploaded files not deleted"),
                       ("file-bytes", "bytes of uploaded files"),
                       ("active-batches", "batches not yet finished")):
        g.add_argument(f"--quota-{flag}", type=int,
                       default=d(f"quota_{flag.replace('-', '_')}"),
                       help=f"{what} per tenant: the OpenAI-Project header, else the API "
                            "key (429 beyond; 0: no limit)")
    g.add_argument("--batch-max-inflight", type=int, default=d("batch_max_inflight"),
                   help="batch lines this replica keeps in the engine at once (each enters "
                        "only while no other request waits, or when its batch's window needs "
                        "it)")
    g.add_argument("--log-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="one JSON line per finished request on stderr (logger "
                        "servelm.requests)")
    g.add_argument("--options-from-stdin", action="store_true", help=argparse.SUPPRESS)
    add_engine_cli_args(p)


def options_from_stdin(args):
    """A replica's options: the parent's parsed serve options as a JSON object on stdin
    (servelm/router/data_parallel.py replica_options), laid over this process's own
    defaults, so a replica is configured by value, never by an edited command line."""
    import json

    for dest, value in json.loads(sys.stdin.read()).items():
        if dest == "options_from_stdin" or not hasattr(args, dest):
            raise ValueError(f"--options-from-stdin: {dest!r} is not a serve option")
        if isinstance(getattr(args, dest), tuple) and isinstance(value, list):
            value = tuple(value)  # JSON has no tuples
        setattr(args, dest, value)
    args.options_from_stdin = False
    return args


def server_config_from_cli(args, model_name: str):
    from servelm.server.app import ServerConfig

    return ServerConfig(
        served_model_name=args.served_model_name or model_name,
        api_key=args.api_key or os.environ.get("SERVELM_API_KEY") or None,
        max_n=args.max_n, max_queue=args.max_queue, request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, slo_spec=args.slo_spec,
        max_body_bytes=args.max_body_bytes,
        write_timeout=args.write_timeout, peak_bandwidth=args.peak_bandwidth,
        peak_flops=args.peak_flops, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, request_log=args.request_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint, state_store=args.state_store,
        max_file_bytes=args.max_file_bytes, max_batch_lines=args.max_batch_lines,
        max_active_batches=args.max_active_batches,
        batch_max_inflight=args.batch_max_inflight, quota_files=args.quota_files,
        quota_file_bytes=args.quota_file_bytes,
        quota_active_batches=args.quota_active_batches,
        **{name: getattr(args, name) for name in _LIMIT_FLAGS})


_LIMIT_FLAGS = ("max_prompts", "max_choices", "header_timeout", "keep_alive_timeout",
                "max_connections", "max_image_bytes", "max_image_pixels",
                "max_images_per_request", "allowed_image_hosts")


def _host_list(text: str) -> tuple[str, ...]:
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())


def _setup_request_log(enabled: bool) -> None:
    log = logging.getLogger("servelm.requests")
    log.propagate = False
    if enabled:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)


def handler(args) -> int:
    if getattr(args, "options_from_stdin", False):
        args = options_from_stdin(args)
    if args.backend == "ray":
        from servelm.router.ray_backend import serve_ray
        from servelm.serve.config_file import file_flags

        _setup_request_log(args.log_requests)
        return serve_ray(args, _serve_argv() + file_flags(args))  # a file's flags are given
    if args.ray_address is not None:  # for --parallel-launcher ray in the core, our child
        os.environ["RAY_ADDRESS"] = args.ray_address
    if args.disagg:
        from servelm.router.disagg import serve_disagg

        _setup_request_log(args.log_requests)
        return serve_disagg(args)
    if args.data_parallel_size > 1:
        from servelm.router.data_parallel import serve_data_parallel

        _setup_request_log(args.log_requests)
        return serve_data_parallel(args)
    from servelm.config import engine_args_from_cli

    _setup_request_log(args.log_requests)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # fail before the slow model load if the port is taken
    if args.slo_spec is not None:  # and if the SLO spec cannot be used
        from servelm.slo import SLOSpec, SLOSpecError

        try:
            SLOSpec.load(args.slo_spec)
        except SLOSpecError as exc:
            print(f"servelm serve: error: {exc}", file=sys.stderr)
            return 2
    from servelm.server.state_store import check_state_store

    try:  # and if the state store's URL is unusable or its server unreachable
        check_state_store(args.state_store)
    except ValueError as exc:
        print(f"servelm serve: error: {exc}", file=sys.stderr)
        return 2
    engine_args = _with_kv_address(engine_args_from_cli(args), args)
    if args.engine_core == "process":
        engine, built = _start_core(engine_args)
        if engine is None:
            return 1
    else:
        from servelm.engine_builder import build_engine

        engine, built = build_engine(engine_args), time.time()
    import uvicorn

    from servelm.server.app import build_app
    from servelm.server.draining_server import DrainingServer, uvicorn_options

    config = server_config_from_cli(args, engine.model_name or args.model)
    app = build_app(engine, config)
    if engine_args.disagg_role != "colocated":  # GET /v1/disagg: what a router needs
        from servelm.disagg.http import info

        app.state.servelm.disagg = info(engine_args)
    app.state.servelm.metrics.recorder.max_num_batched_tokens = \
        engine_args.max_num_batched_tokens  # the doctor's advice on the chunk budget
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    def ready_message() -> str:
        record = _startup_record(built)
        startup.export_metrics(app.state.servelm.metrics.registry, record)
        return (f"[servelm] serving {config.served_model_name} at http://{shown}:{port}/v1 "
                f"(ready {record['ready_s']:.1f} s after start: {startup.timer().summary()})")

    server = DrainingServer(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5,
                                           **uvicorn_options(app.state.servelm)),
                            state=app.state.servelm, drain_timeout=config.drain_timeout,
                            ready_message=ready_message)
    if args.engine_core == "process":
        def core_died(cause: str) -> None:
            # In-flight requests have failed with the cause; exit non-zero so that a
            # supervisor restarts the pair.
            print(f"[servelm] {cause}: exiting", file=sys.stderr, flush=True)
            server.should_exit = True

        engine.on_dead = core_died
    server.run(sockets=[sock])
    return 1 if getattr(engine, "crashed", False) else 0


def _with_kv_address(engine_args, args):
    """A prefill worker without --kv-address listens next to its HTTP port."""
    if engine_args.disagg_role != "prefill" or engine_args.kv_address:
        return engine_args
    import dataclasses

    from servelm.disagg.transport import default_address

    return dataclasses.replace(engine_args, kv_address=default_address(
        engine_args.kv_transport, args.host, args.port))


def _serve_argv() -> list[str]:
    """This command's arguments after `serve` (the Ray backend asks which were given)."""
    argv = sys.argv[1:]
    return argv[argv.index("serve") + 1:] if "serve" in argv else argv

def _start_core(engine_args):
    """(the engine core in its own process, when it was ready), or (None, 0) with the
    reason printed if it fails. The front end's own start-up work (its tokenizer, the HTTP app's imports) runs on a thread
    while the core builds its engine."""
    from concurrent.futures import ThreadPoolExecutor

    from servelm.core_process.client import CoreClient, CoreStartError

    timer = startup.timer()
    spawned = time.time()
    timer.add("frontend_start", spawned - (startup.process_start_time() or spawned))
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="servelm-frontend") as pool:
            tokenizer = pool.submit(_frontend_work, engine_args.model)
            client = CoreClient.spawn(engine_args)
            ready = time.time()
            client.tokenizer = tokenizer.result()
    except (CoreStartError, ValueError, OSError) as exc:
        print(f"[servelm] the engine core failed to start: {exc}", file=sys.stderr, flush=True)
        return None, 0.0
    stages, notes = client.info.startup_stages, client.info.startup_notes
    for name, seconds in stages.items():
        timer.add(name, seconds, notes.get(name))
    timer.add("core_spawn", (ready - spawned) - sum(stages.values()))
    return client, ready


def _frontend_work(model: str):
    """The front end's tokenizer, and the modules serving needs imported (off the path)."""
    import uvicorn  # noqa: F401

    import servelm.server.app  # noqa: F401
    from servelm.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))


def _startup_record(built: float) -> dict:
    """The start-up record once listening: `frontend_ready` closes the stages, which then
    sum to ready_s (process start to now)."""
    timer = startup.timer()
    now = time.time()
    timer.add("frontend_ready", now - built)
    started = startup.process_start_time()
    return {"ready_s": round(now - started if started is not None else timer.total, 4),
            **timer.as_dict()}
