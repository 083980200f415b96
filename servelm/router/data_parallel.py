"""`servelm serve --data-parallel-size N`: N replicas of the model behind one port.

Owns: describing N `servelm serve` replicas (each a front end and its engine core, on
loopback ports of their own, the machine's cores split between them) as ProcessSpecs, each
handed its options by value (the parent's parsed serve options as JSON on its stdin, read by
servelm/serve/cli.py options_from_stdin; no command line is edited), that
the launcher's Supervisor (servelm/launch/) starts, waits for (/health) and stops when the
router stops (SIGTERM each, then SIGKILL after the drain timeout); running the router in
front of them on the public port; logging a replica's death with its last stderr lines.
Never: restarts a replica that died: the router ejects it and the supervisor of the whole
service decides (the same contract as one replica).
"""

from __future__ import annotations

import json
import os
import socket
import sys

from servelm.launch import HttpHealth, LaunchError, ProcessHandle, ProcessSpec, Supervisor

# The parent's serve options a replica does not inherit (it keeps its own defaults): it is
# one plain `serve` on a port of its own (the Ray backend's options among them).
PARENT_OPTIONS = ("host", "port", "data_parallel_size", "router_policy", "backend",
                  "num_replicas", "ray_address", "replica_cpus", "replica_gpus", "autoscale")
_NOT_SERVE_OPTIONS = ("func", "command", "verbose", "options_from_stdin")


def replica_options(args, port: int, threads: int | None,
                    drop: tuple[str, ...] = (), **changes) -> dict:
    """The parent's parsed serve options for one replica (JSON-ready): its own port on
    loopback, its share of the cores unless --threads was given, without PARENT_OPTIONS
    and `drop` (the replica keeps its defaults for those), with `changes` on top."""
    skip = set(PARENT_OPTIONS) | set(_NOT_SERVE_OPTIONS) | set(drop)
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()
           if k not in skip}
    out.update(host="127.0.0.1", port=port)
    if threads is not None and args.num_threads is None:
        out["num_threads"] = threads
    out.update(changes)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_spec(options: dict, what: str = "replica", timeout: float = 900.0) -> ProcessSpec:
    """One local `servelm serve` replica with `options` (replica_options) as JSON on its
    stdin: ready once it answers /health; its stderr reaches ours through the supervisor
    (which keeps its last lines for the death report); it is killed when this process ends,
    however that happens (the router was the only way in, so it has nothing left to drain;
    its core sees the connection end and frees its blocks)."""
    url = f"http://127.0.0.1:{options['port']}"
    return ProcessSpec(f"{what} {url}", (sys.executable, "-m", "servelm.cli", "serve",
                                         options["model"], "--options-from-stdin"),
                       config=json.dumps(options).encode(),
                       readiness=HttpHealth(url + "/health"), ready_timeout_s=timeout)


def url_of(handle: ProcessHandle) -> str:
    return handle.spec.readiness.url.removesuffix("/health")


def start_replicas(supervisor: Supervisor, args, n: int,
                   timeout: float = 900.0) -> list[ProcessHandle]:
    """The replicas' handles once every one answers /health (LaunchError naming the one
    that died or was late, the others stopped)."""
    threads = max(1, (os.cpu_count() or 1) // n)
    return supervisor.start_all([replica_spec(replica_options(args, _free_port(), threads),
                                              timeout=timeout) for _ in range(n)])


def report_deaths(supervisor: Supervisor, what: str):
    """Log each replica that dies while serving, with its last stderr lines (the router
    ejects it; nothing restarts it). One that drained and exited 0 is not reported: a
    terminal's Ctrl-C reaches the replicas too. Returns the watch, to stop before stopping
    them."""
    def on_death(death) -> None:
        if death.returncode != 0:
            print(f"[servelm] {what}: {death.describe()}", file=sys.stderr, flush=True)

    return supervisor.watch(on_death)


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run_router(args, sock: socket.socket, urls: list[str], what: str,
               controllers: list | None = None) -> None:
    """The router (args.router_policy) over `urls` on `sock`, until SIGTERM/SIGINT;
    `controllers` (an autoscaler) run in its event loop beside the replicas' probes."""
    import uvicorn

    from servelm.router.app import RouterConfig, build_router_app
    from servelm.router.cli import RouterServer
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    tokenizer = None
    try:
        from servelm.loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model))
    except (ValueError, OSError):
        pass  # token-id prompts still get a cache estimate
    api_key = args.api_key or os.environ.get("SERVELM_API_KEY") or None
    replicas = ReplicaSet(urls, probe_interval=0.5, api_key=api_key)
    replicas.controllers = list(controllers or [])
    app = build_router_app(replicas, make_policy(args.router_policy),
                           RouterConfig(args.router_policy), tokenizer)
    server = RouterServer(uvicorn.Config(app, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))
    host, port = sock.getsockname()[:2]
    print(f"[servelm] serving {args.served_model_name or args.model} at "
          f"http://{host}:{port}/v1 ({what}, {args.router_policy} routing)",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])


def serve_data_parallel(args) -> int:
    """The router on args.host:args.port over args.data_parallel_size replicas."""
    sock = bind_socket(args.host, args.port)
    n = args.data_parallel_size
    supervisor = Supervisor()
    try:
        handles = start_replicas(supervisor, args, n)
    except LaunchError as exc:
        print(f"[servelm] data parallel: {exc}", file=sys.stderr, flush=True)
        return 1
    watch = report_deaths(supervisor, "data parallel")
    try:
        run_router(args, sock, [url_of(h) for h in handles], f"{n} replicas")
    finally:
        watch.stop()
        supervisor.stop_all(args.drain_timeout + 5)
    return 0


__all__ = ["PARENT_OPTIONS", "bind_socket", "replica_options", "replica_spec", "report_deaths",
           "run_router", "serve_data_parallel", "start_replicas", "url_of"]
