"""`servelm serve --data-parallel-size N`: N replicas of the model behind one port.

Owns: starting N `servelm serve` replicas (each a front end and its engine core, on loopback
ports of their own, the machine's cores split between them), waiting until each answers
/health, running the router in front of them on the public port, and stopping them all
when the router stops (SIGTERM each, then SIGKILL after the drain timeout).
Never: restarts a replica that died: the router ejects it and the supervisor of the whole
service decides (the same contract as one replica).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# Flags of the parent that the replicas must not inherit (value-taking ones).
# (The Ray backend's own flags among them: a replica is always a plain single `serve`.)
PARENT_FLAGS = {"--port", "--host", "--data-parallel-size", "--router-policy", "--backend",
                "--num-replicas", "--ray-address", "--replica-cpus", "--replica-gpus",
                "--autoscale"}


def strip_flags(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` without the value-taking `flags` (as `--flag value` or `--flag=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def replica_argv(argv: list[str], port: int, threads: int | None) -> list[str]:
    """The parent's `serve` arguments for one replica: its own port on loopback, its share of
    the cores unless --threads was given."""
    out = strip_flags(argv, PARENT_FLAGS)
    out += ["--host", "127.0.0.1", "--port", str(port)]
    if threads is not None and not any(a.split("=", 1)[0] == "--threads" for a in argv):
        out += ["--threads", str(threads)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(procs, urls: list[str], timeout: float, what: str = "replica") -> None:
    """Return once every process answers /health 200; RuntimeError if one exits first or
    the deadline passes (naming which)."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"{what} {urls[i]} exited with code {procs[i].returncode} "
                                   "while starting")
            try:
                if httpx.get(urls[i] + "/health", timeout=1.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}s {[urls[i] for i in sorted(pending)]} not ready in "
                               f"{timeout:g} s")
        time.sleep(0.2)


def start_replicas(serve_argv: list[str], n: int, timeout: float = 900.0):
    """(processes, urls) once every replica answers /health (or raises, killing them)."""
    threads = max(1, (os.cpu_count() or 1) // n)
    procs, urls = [], []
    try:
        for _ in range(n):
            port = _free_port()
            cmd = [sys.executable, "-m", "servelm.cli", "serve",
                   *replica_argv(serve_argv, port, threads)]
            procs.append(subprocess.Popen(cmd))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(procs, urls, timeout)
    except BaseException:
        stop_replicas(procs, 5.0)
        raise
    return procs, urls


def stop_replicas(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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


def serve_data_parallel(args, serve_argv: list[str]) -> int:
    """The router on args.host:args.port over args.data_parallel_size replicas."""
    sock = bind_socket(args.host, args.port)
    n = args.data_parallel_size
    try:
        procs, urls = start_replicas(serve_argv, n)
    except RuntimeError as exc:
        print(f"[servelm] data parallel: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        run_router(args, sock, urls, f"{n} replicas")
    finally:
        stop_replicas(procs, args.drain_timeout + 5)
    return 0


__all__ = ["PARENT_FLAGS", "bind_socket", "replica_argv", "run_router", "serve_data_parallel", "start_replicas",
           "stop_replicas", "strip_flags"]
