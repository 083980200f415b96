"""`servelm serve MODEL`: build the engine, then serve the OpenAI API with uvicorn.

Owns: the serve flags' assembly (MODEL and --config; the others are built from the fields
of ServerConfig, TopologyConfig and EngineArgs), the topology chosen from TopologyConfig,
logging of the per-request JSON lines, and SIGTERM/SIGINT handling:
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


# The serve flags' argument groups (Flag.group -> title), in --help's order; the engine's
# follow (config/flags.py GROUPS).
SERVE_GROUPS = {"server": "server", "ray": "replicas on Ray"}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serve flags (`servelm config show` takes them too): MODEL and --config here, the
    rest built from the fields of ServerConfig (servelm/server/server_config.py),
    TopologyConfig (serve/topology.py) and EngineArgs, each with its default and help (their
    option(): config/option.py). Each is also a key of a --config file (config_file.py)."""
    from servelm.config import add_engine_cli_args
    from servelm.config.flags import add_option_flags
    from servelm.loader.model_cache import DEFAULT_MODEL
    from servelm.serve.topology import TopologyConfig
    from servelm.server.server_config import ServerConfig

    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="cached model name, .gguf file, HF directory or Hugging Face name "
                        f"ORG/NAME[:QUANT][@REV] (default {DEFAULT_MODEL})")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="serve options from a YAML file: each flag's long name is a key, the "
                        "topology flags under `topology:`; flags given here override it "
                        "(`servelm config show` prints the result; docs/server.md)")
    add_option_flags(p, (ServerConfig, TopologyConfig), SERVE_GROUPS)
    # a replica's options by value (router/data_parallel.py), not an option of anyone's
    p.add_argument("--options-from-stdin", action="store_true", help=argparse.SUPPRESS)
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
    from servelm.config.flags import options_from_cli
    from servelm.server.server_config import ServerConfig

    return options_from_cli(
        ServerConfig, args, served_model_name=args.served_model_name or model_name,
        api_key=args.api_key or os.environ.get("SERVELM_API_KEY") or None)


def _setup_request_log(enabled: bool) -> None:
    log = logging.getLogger("servelm.requests")
    log.propagate = False
    if enabled:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)


def handler(args) -> int:
    from servelm.config.flags import options_from_cli
    from servelm.serve.topology import TopologyConfig

    if getattr(args, "options_from_stdin", False):
        args = options_from_stdin(args)
    topology = options_from_cli(TopologyConfig, args)
    if topology.backend == "ray":
        from servelm.router.ray_backend import serve_ray
        from servelm.serve.config_file import file_flags

        _setup_request_log(args.log_requests)
        return serve_ray(args, _serve_argv() + file_flags(args))  # a file's flags are given
    if topology.ray_address is not None:  # for --parallel-launcher ray in the core, our child
        os.environ["RAY_ADDRESS"] = topology.ray_address
    if topology.disagg:
        from servelm.router.disagg import serve_disagg

        _setup_request_log(args.log_requests)
        return serve_disagg(args)
    if topology.data_parallel_size > 1:
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
    if topology.engine_core == "process":
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
    if topology.engine_core == "process":
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
    reason printed if it fails. The front end's own start-up work (its tokenizer, the HTTP
    app's imports) runs on a thread while the core builds its engine."""
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
