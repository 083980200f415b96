"""`servelm serve --backend ray --num-replicas N`: replicas as Ray actors, the router in front.

Owns: connecting to a Ray cluster (or starting a local one), placing each replica as an actor
that holds the replica's resources (`--replica-cpus`, `--replica-gpus`) on some node, the
actor starting the very same `servelm serve` process a single machine runs (bound to its
node's address, on a free port), and stopping them all when the router stops.
Never: manages machines, restarts a dead replica, or schedules anything itself: Ray places
the actors (spread over the nodes) and the router ejects a replica that stops answering.
With --autoscale POLICY_FILE, servelm/autoscale/controller.py adds and removes actors
through `RayReplicas` while the router runs (docs/autoscale.md).

    driver (this process)                 node A                    node B
    +---------------------+      +----------------------+   +----------------------+
    | router :PORT        | ---> | ReplicaActor (1 CPU) |   | ReplicaActor (1 CPU) |
    | ray.get(actor.start)|      |  `servelm serve`     |   |  `servelm serve`     |
    +---------------------+      |   front end + core   |   |   front end + core   |
                                 +----------------------+   +----------------------+

The replica process is the actor's child with PR_SET_PDEATHSIG: when Ray kills the actor
(or its node's raylet dies) the replica gets SIGTERM and drains, never outliving its actor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

class RayUnavailableError(RuntimeError):
    pass


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailableError("--backend ray needs Ray: pip install 'servelm[ray]'") \
            from None
    return ray


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ReplicaActor:
    """One replica on one node: a `servelm serve` child process, its URL and its end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def node_address(self) -> str:
        """The address this actor's node joined the cluster with (`ray start
        --node-ip-address`), which the driver can reach; not a guess from the interfaces."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return node["NodeManagerAddress"]
        return ray.util.get_node_ip_address()

    def start(self, serve_argv: list[str], timeout: float) -> str:
        """Start the replica and return its base URL once it answers /health."""
        import httpx

        host = self.node_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "servelm.cli", "serve", *serve_argv,
               "--host", host, "--port", str(port)]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(cmd, preexec_fn=preexec)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica on {host} exited with code "
                                   f"{self.proc.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop(5.0)
                raise RuntimeError(f"replica on {host} not ready in {timeout:g} s")
            time.sleep(0.2)

    def pid(self) -> int | None:
        """The replica process's pid (tests kill it to see the router eject it)."""
        return self.proc.pid if self.proc is not None else None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (the replica drains), SIGKILL after `timeout`; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def replica_serve_argv(argv: list[str], cpus: float) -> list[str]:
    """The driver's `serve` arguments for one actor's replica: the driver-only flags
    removed, and `--threads` set to the actor's CPUs unless given."""
    from servelm.router.data_parallel import PARENT_FLAGS, strip_flags

    out = strip_flags(argv, PARENT_FLAGS)
    if not any(a.split("=", 1)[0] == "--threads" for a in out):
        out += ["--threads", str(max(1, int(cpus)))]
    return out


def connect(address: str | None):
    """ray.init against `address` (or $RAY_ADDRESS, or a cluster started on this machine
    with `ray start`); with none of those, a local Ray instance for this process."""
    ray = _import_ray()
    import logging

    address = address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=True)
    return ray


def start_actors(ray, serve_argv: list[str], n: int, cpus: float, gpus: float,
                 timeout: float = 900.0):
    """(actors, urls): n replicas placed by Ray (spread over nodes), each answering /health."""
    cls = ray.remote(ReplicaActor)
    actors = [cls.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy="SPREAD",
                          max_restarts=0).remote() for _ in range(n)]
    argv = replica_serve_argv(serve_argv, cpus)
    try:
        urls = ray.get([a.start.remote(argv, timeout) for a in actors], timeout=timeout + 60)
    except BaseException:
        stop_actors(ray, actors, 5.0)
        raise
    return actors, urls


def stop_actors(ray, actors, timeout: float) -> None:
    try:
        ray.get([a.stop.remote(timeout) for a in actors], timeout=timeout + 30)
    except Exception as exc:  # an actor that died already: nothing left to drain
        print(f"[servelm] stopping replicas: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
    for a in actors:
        ray.kill(a)


class RayReplicas:
    """The autoscaler's backend (servelm/autoscale/controller.py): one more replica actor,
    placed by Ray, or one stopped. Keeps every actor it has, for the final stop."""

    def __init__(self, ray, serve_argv: list[str], cpus: float, gpus: float, actors,
                 drain_timeout: float, timeout: float = 900.0):
        self.ray = ray
        self.argv = replica_serve_argv(serve_argv, cpus)
        self.cpus, self.gpus = cpus, gpus
        self.actors = list(actors)
        self.drain_timeout = drain_timeout
        self.timeout = timeout

    async def start_replica(self):
        import asyncio

        cls = self.ray.remote(ReplicaActor)
        actor = cls.options(num_cpus=self.cpus, num_gpus=self.gpus,
                            scheduling_strategy="SPREAD", max_restarts=0).remote()
        self.actors.append(actor)
        try:
            url = await asyncio.to_thread(self.ray.get, actor.start.remote(self.argv,
                                                                           self.timeout),
                                          timeout=self.timeout + 60)
        except BaseException:
            await self.stop_replica(actor)
            raise
        return actor, url

    async def stop_replica(self, actor) -> None:
        import asyncio

        await asyncio.to_thread(stop_actors, self.ray, [actor], self.drain_timeout)
        if actor in self.actors:
            self.actors.remove(actor)


def _autoscale_setup(args):
    """(policy config, first replica count) for --autoscale, or (None, --num-replicas)."""
    from servelm.autoscale.controller import check_controller_config
    from servelm.autoscale.policy import AutoscaleConfig

    if args.autoscale is None:
        return None, args.num_replicas
    config = AutoscaleConfig.load(args.autoscale)
    check_controller_config(config)
    return config, min(config.max_replicas, max(config.min_replicas, args.num_replicas))


def serve_ray(args, serve_argv: list[str]) -> int:
    """The router on args.host:args.port over args.num_replicas Ray actors, or with
    --autoscale over as many as the policy asks for (from min_replicas)."""
    from servelm.autoscale.policy import AutoscaleConfigError
    from servelm.router.data_parallel import bind_socket, run_router

    if args.num_replicas < 1:
        print("[servelm] --num-replicas must be at least 1", file=sys.stderr, flush=True)
        return 2
    try:
        config, num_replicas = _autoscale_setup(args)
    except AutoscaleConfigError as exc:
        print(f"[servelm] {exc}", file=sys.stderr, flush=True)
        return 2
    sock = bind_socket(args.host, args.port)  # fail before placing actors if it is taken
    try:
        ray = connect(args.ray_address)
    except (RayUnavailableError, ConnectionError, RuntimeError) as exc:
        print(f"[servelm] ray: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        try:
            actors, urls = start_actors(ray, serve_argv, num_replicas,
                                        args.replica_cpus, args.replica_gpus)
        except Exception as exc:
            print(f"[servelm] ray: replicas failed to start: {exc}", file=sys.stderr,
                  flush=True)
            return 1
        backend = RayReplicas(ray, serve_argv, args.replica_cpus, args.replica_gpus, actors,
                              args.drain_timeout + 5)
        controllers, what = [], f"{len(urls)} replicas on Ray"
        if config is not None:
            from servelm.autoscale.controller import AutoscaleController

            controllers.append(AutoscaleController(config, backend, dict(zip(urls, actors))))
            what += (f", autoscaled {config.min_replicas}..{config.max_replicas} on "
                     f"{config.signal} (target {config.target:g} per replica)")
        try:
            run_router(args, sock, urls, what, controllers)
        finally:
            stop_actors(ray, backend.actors, args.drain_timeout + 5)
    finally:
        ray.shutdown()
    return 0


__all__ = ["RayReplicas", "ReplicaActor", "connect", "replica_serve_argv", "serve_ray",
           "start_actors", "stop_actors"]
