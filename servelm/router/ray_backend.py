"""`servelm serve --backend ray --num-replicas N`: replicas as Ray actors, the router in front.

Owns (joining the cluster is servelm/launch/ray_cluster.py's): placing each replica as an actor
that holds the replica's resources (`--replica-cpus`, `--replica-gpus`) on some node, the
actor starting the very same `servelm serve` process a single machine runs (bound to its
node's address, on a free port, told the cluster's address; its options handed by value,
as for local replicas: servelm/router/data_parallel.py replica_options), and stopping them all when the
router stops. A model-parallel replica (--tensor-parallel-size x --pipeline-parallel-size
> 1) gets a placement group of one bundle per rank (the replica's resources split evenly,
strategy --parallel-placement): its actor holds bundle 0 (rank 0, the replica's engine core,
runs in the actor's child), and the replica's `--parallel-launcher ray` puts ranks 1.. into
bundles 1.. of that same group (servelm/parallel/ray_launcher.py), so nothing is reserved
twice; stopping the replica removes its group.
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

    a TP=2 replica: placement group [bundle 0: ReplicaActor -> serve -> core (rank 0)]
                                    [bundle 1: WorkerActor rank 1, started by the core ]

The replica process is the actor's child, a ProcessSpec started by the launcher's Supervisor
(servelm/launch/) with parent-death signal SIGTERM: when Ray kills the actor (or its node's
raylet dies) the replica gets SIGTERM and drains, never outliving its actor.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import NamedTuple

from servelm.launch import INHERIT, HttpHealth, ProcessHandle, ProcessSpec, Resources, Supervisor
from servelm.launch.ray_cluster import PLACEMENT_GROUP_ENV, RayUnavailableError, connect

PLACEMENT_TIMEOUT_S = 120.0  # a replica group the cluster cannot hold fails the start


class ReplicaActor:
    """One replica on one node: a `servelm serve` child process (started by the launcher's
    Supervisor in this actor), its URL and its end."""

    def __init__(self) -> None:
        self.handle: ProcessHandle | None = None
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

    def start(self, options: dict, timeout: float, placement_group: str | None = None) -> str:
        """Start the replica with `options` (replica_serve_options, on its stdin, with this
        node's address and a free port) and return its base URL once it answers /health.
        The replica joins this actor's cluster ($RAY_ADDRESS: its GCS address; the rest of
        the environment, an auth token included, is this actor's) and, given the replica's
        placement group id, places its other ranks there."""
        import ray

        env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        if placement_group is not None:
            env[PLACEMENT_GROUP_ENV] = placement_group
        host = self.node_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        options = {**options, "host": host, "port": port}
        spec = ProcessSpec(f"replica on {host}", (sys.executable, "-m", "servelm.cli", "serve",
                                                  options["model"], "--options-from-stdin"),
                           config=json.dumps(options).encode(),
                           resources=Resources(env=env), readiness=HttpHealth(
                               self.url + "/health"), ready_timeout_s=timeout,
                           # Ray keeps the actor's output; the replica drains on the signal
                           stderr=INHERIT, parent_death_signal=signal.SIGTERM)
        supervisor = Supervisor(stop_at_exit=False)
        self.handle = supervisor.start(spec, wait=False)
        supervisor.wait_ready([self.handle])  # LaunchError (it is stopped) if not
        return self.url

    def pid(self) -> int | None:
        """The replica process's pid (tests kill it to see the router eject it)."""
        return self.handle.pid if self.handle is not None else None

    def returncode(self) -> int | None:
        return None if self.handle is None else self.handle.poll()

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (the replica drains), SIGKILL after `timeout`; the exit code."""
        if self.handle is None:
            return None
        return self.handle.stop(timeout)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a.split("=", 1)[0] == flag for a in argv)


def replica_serve_options(args, cpus: float, ranks_on_ray: bool = False) -> dict:
    """The driver's parsed `serve` options for one actor's replica (JSON-ready; the actor
    adds its node's host and a free port): the driver-only options left at the replica's
    own defaults, its threads the replica's CPUs unless --threads was given (a
    model-parallel replica splits them between its ranks), and with ranks_on_ray
    parallel_launcher ray (ranks_on_ray is false when another launcher was asked for)."""
    from servelm.router.data_parallel import replica_options

    out = replica_options(args, 0, max(1, int(cpus)))
    del out["host"], out["port"]
    if ranks_on_ray:
        out["parallel_launcher"] = "ray"
    return out


class ReplicaShape(NamedTuple):
    """What one replica holds on the cluster: its resources, and with more than one rank a
    placement group of a bundle per rank (each 1/world of them), placed by `strategy`."""

    cpus: float  # the whole replica's (all ranks together)
    gpus: float
    world: int = 1  # tensor x pipeline parallel ranks
    strategy: str = "PACK"
    is_grouped: bool = False  # ranks 1.. placed by Ray in the replica's placement group

    @classmethod
    def from_args(cls, args, serve_argv: list[str]) -> ReplicaShape:
        """From `serve`'s flags: a model-parallel replica is grouped unless its ranks are
        asked to be local processes (an explicit --parallel-launcher process: then its
        actor holds all of the replica's resources and the ranks are its node's processes)."""
        world = (getattr(args, "tensor_parallel_size", 1) or 1) * \
            (getattr(args, "pipeline_parallel_size", 1) or 1)
        grouped = world > 1 and not (_has_flag(serve_argv, "--parallel-launcher")
                                     and args.parallel_launcher != "ray")
        return cls(args.replica_cpus, args.replica_gpus, world,
                   getattr(args, "parallel_placement", "PACK"), grouped)

    def bundles(self) -> list[dict]:
        n = self.world if self.is_grouped else 1
        one = {k: v / n for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}
        return [dict(one) for _ in range(n)]

    def options(self, args) -> dict:
        return replica_serve_options(args, self.cpus, self.is_grouped)


def new_replica(ray, shape: ReplicaShape):
    """(actor, its placement group or None): one replica's actor, not started yet. A grouped
    replica's group is reserved first (bundle 0 the actor's); one the cluster cannot hold
    in PLACEMENT_TIMEOUT_S is removed and raised as a RuntimeError naming its bundles."""
    cls = ray.remote(ReplicaActor)
    if not shape.is_grouped:
        return cls.options(num_cpus=shape.cpus, num_gpus=shape.gpus,
                           scheduling_strategy="SPREAD", max_restarts=0).remote(), None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = shape.bundles()
    pg = placement_group(bundles, strategy=shape.strategy,
                         name=f"servelm-replica-{os.getpid()}-{time.monotonic_ns()}")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"the cluster did not place a replica's {len(bundles)} bundles "
                           f"{bundles[0]} (parallel_placement {shape.strategy}) in "
                           f"{PLACEMENT_TIMEOUT_S:g} s; it has {ray.cluster_resources()}")
    actor = cls.options(num_cpus=bundles[0].get("CPU", 0.0),
                        num_gpus=bundles[0].get("GPU", 0.0), max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=0)).remote()
    return actor, pg


class RayReplicas:
    """The replicas on Ray: their actors and placement groups, started and stopped; also
    the autoscaler's backend (servelm/autoscale/controller.py: one more replica, or one
    stopped). Keeps every actor it has, for the final stop."""

    def __init__(self, ray, args, shape: ReplicaShape, drain_timeout: float,
                 timeout: float = 900.0):
        self.ray = ray
        self.shape = shape
        self.options = shape.options(args)
        self.actors: list = []
        self.groups: dict = {}  # actor -> its placement group (grouped replicas)
        self.drain_timeout = drain_timeout
        self.timeout = timeout

    def _new(self):
        actor, pg = new_replica(self.ray, self.shape)
        self.actors.append(actor)
        if pg is not None:
            self.groups[actor] = pg
        return actor, actor.start.remote(self.options, self.timeout,
                                         None if pg is None else pg.id.hex())

    def start(self, n: int) -> list[str]:
        """n replicas placed by Ray, each answering /health: their URLs (on failure every
        replica started is stopped)."""
        try:
            refs = [self._new()[1] for _ in range(n)]
            return self.ray.get(refs, timeout=self.timeout + 60)
        except BaseException:
            self.stop(list(self.actors))
            raise

    def stop(self, actors: list) -> None:
        """Drain the replicas (their actors SIGTERM them), kill the actors, remove their
        groups."""
        stop_actors(self.ray, actors, self.drain_timeout)
        for actor in actors:
            pg = self.groups.pop(actor, None)
            if pg is not None:
                try:
                    self.ray.util.remove_placement_group(pg)
                except Exception as exc:  # the cluster went first: keep stopping the rest
                    print(f"[servelm] removing a replica's placement group: "
                          f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            if actor in self.actors:
                self.actors.remove(actor)

    async def start_replica(self):
        import asyncio

        actor, ref = await asyncio.to_thread(self._new)
        try:
            url = await asyncio.to_thread(self.ray.get, ref, timeout=self.timeout + 60)
        except BaseException:
            await self.stop_replica(actor)
            raise
        return actor, url

    async def stop_replica(self, actor) -> None:
        import asyncio

        await asyncio.to_thread(self.stop, [actor])


def stop_actors(ray, actors, timeout: float) -> None:
    try:
        ray.get([a.stop.remote(timeout) for a in actors], timeout=timeout + 30)
    except Exception as exc:  # an actor that died already: nothing left to drain
        print(f"[servelm] stopping replicas: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
    for a in actors:
        ray.kill(a)


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
        shape = ReplicaShape.from_args(args, serve_argv)
        backend = RayReplicas(ray, args, shape, args.drain_timeout + 5)
        try:
            urls = backend.start(num_replicas)
        except Exception as exc:
            print(f"[servelm] ray: replicas failed to start: {exc}", file=sys.stderr,
                  flush=True)
            return 1
        actors = list(backend.actors)
        controllers, what = [], f"{len(urls)} replicas on Ray"
        if shape.is_grouped:
            what += (f", {shape.world} ranks each in its own placement group "
                     f"({shape.strategy})")
        if config is not None:
            from servelm.autoscale.controller import AutoscaleController

            controllers.append(AutoscaleController(config, backend, dict(zip(urls, actors))))
            what += (f", autoscaled {config.min_replicas}..{config.max_replicas} on "
                     f"{config.signal} (target {config.target:g} per replica)")
        try:
            run_router(args, sock, urls, what, controllers)
        finally:
            backend.stop(list(backend.actors))
    finally:
        ray.shutdown()
    return 0


__all__ = ["PLACEMENT_GROUP_ENV", "RayReplicas", "ReplicaActor", "ReplicaShape", "connect",
           "new_replica", "replica_serve_options", "serve_ray", "stop_actors"]
