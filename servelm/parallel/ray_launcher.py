"""`--parallel-launcher ray`: a replica's ranks placed over a Ray cluster with a placement group.

Owns: reserving one placement group of a bundle per rank (its share of the CPUs, or one GPU)
with the strategy --parallel-placement (PACK by default: as few nodes as fit), bundle 0
pinned to this process's Ray node by its node id (rank 0, the scheduler, runs here and its
compute is bundle 0's), or taking the group the router's Ray backend reserved for this
replica (its id in $SERVELM_RAY_PLACEMENT_GROUP, bundle 0 held by the replica's actor, which
started this process); ranks 1..N-1 as `WorkerActor`s, each scheduled into its own bundle
(PlacementGroupSchedulingStrategy) and running the very worker main the process launcher's
children run (servelm/parallel/worker.py `run`, with the RankMain's build), told its place
by a codec WorkerStart frame (rank, world, and rank 0's rendezvous: this node's Ray address
and a free port); and
`RayWorkerSet`, the WorkerSet of actors: a rank whose actor died or whose main returned is
dead, so ParallelRunner fails the replica exactly as for a dead process, and teardown kills
the actors and removes the placement group (only one it reserved itself). Never: starts,
stops or sizes the cluster (`ray start`; the router's Ray backend,
servelm/router/ray_backend.py, places whole replicas), or sends pickled objects to the
workers but the build function, by name (Ray carries the frame's bytes).

    this process (node A): rank 0            placement group, one bundle per rank
    +--------------------------------+       +-----------------------------------+
    | scheduler, rank 0's shard      |       | bundle 0: node A (rank 0's CPUs)  |
    | TCP rendezvous A:port  <-------+-------+ bundle 1: WorkerActor rank 1      |
    +--------------------------------+       | bundle 2: WorkerActor rank 2 ...  |
                                             +-----------------------------------+
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import time
from typing import Callable

import msgspec
import torch

from servelm.config import EngineArgs
from servelm.core import codec
from servelm.core.codec import WorkerStart
# Set by the router's Ray backend for the `servelm serve` it starts in a replica's actor: the
# hex id of the placement group it reserved for the replica, one bundle per rank, bundle 0
# the actor's own. Not a user option: a handoff down one process tree, like $RAY_ADDRESS.
from servelm.launch.ray_cluster import PLACEMENT_GROUP_ENV
from servelm.parallel.group import ParallelGroup
from servelm.parallel.launcher import JOIN_TIMEOUT_S, RankMain, WorkerSet, split_cpus

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # a group the cluster cannot hold fails the build, not hangs it
# Ray's own label on every node since labels came in: bundle 0 selects this process's node
NODE_ID_LABEL = "ray.io/node-id"
# Older Ray without bundle label selectors: bundle 0 asks for a sliver of this node's
# address resource instead (ambiguous where several Ray nodes share one address)
NODE_RESOURCE_SLIVER = 0.001


class WorkerPlace(msgspec.Struct):
    """Where a rank's actor runs, as it reports it (codec bytes over Ray, never pickle)."""

    node: str  # its node's address in the cluster
    node_id: str  # its Ray node's id (hex): several nodes may share one address
    pid: int
    placement_group: str | None  # the group's id (hex) Ray scheduled it in
    gpus: list[int] = []  # the GPU ids Ray gave it (it sees them as cuda:0..)


_place_decoder = codec.Decoder(WorkerPlace)


class PlacementError(RuntimeError):
    """The cluster did not place the replica's placement group in time."""


class WorkerActor:
    """One rank of a replica inside a Ray actor (a process Ray started in the rank's
    bundle): first `where`, then `run` for as long as the replica lives. Both speak codec
    bytes (Ray carries them); `build` (the RankMain's, pickled by name) builds its shard."""

    def __init__(self, build: Callable):
        self.build = build

    def where(self) -> bytes:
        """A WorkerPlace: its node's address, its pid, its group, the GPUs Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        return codec.encode(WorkerPlace(ray.util.get_node_ip_address(), ctx.get_node_id(),
                                        os.getpid(), ctx.get_placement_group_id(),
                                        [int(g) for g in ray.get_gpu_ids()]))

    def run(self, frame: bytes) -> int:
        """The worker main (servelm/parallel/worker.py) for the WorkerStart in frame."""
        from servelm.parallel import worker

        return worker.run(codec.worker_start_decoder.decode(frame), self.build)


class RayWorkerSet(WorkerSet):
    """Ranks 1..N-1 as Ray actors in one placement group."""

    def __init__(self, ray, pg, actors: dict, runs: dict, places: dict,
                 owns_group: bool = True):
        self.ray, self.pg = ray, pg
        self.owns_group = owns_group  # False: the router's Ray backend reserved it
        self.actors = actors  # rank -> actor handle
        self.runs = runs  # rank -> the ObjectRef of its `run` (ready: the rank has ended)
        self.places: dict[int, WorkerPlace] = places
        self.procs = {}
        self._removed = False
        atexit.register(self.terminate)

    def dead(self) -> str:
        if self._removed:
            return "; ".join(f"worker rank {r} (Ray actor, pid {p.pid}) stopped"
                             for r, p in self.places.items())
        refs = list(self.runs.values())
        if not refs:
            return ""
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for rank, ref in self.runs.items():
            if ref in ready:
                place = self.places[rank]
                out.append(f"worker rank {rank} (Ray actor on {place.node}, pid {place.pid}) "
                           f"{self._how(ref)}")
        return "; ".join(out)

    def _how(self, ref) -> str:
        try:
            return f"exit code {self.ray.get(ref, timeout=0)}"
        except self.ray.exceptions.RayActorError:
            return "died (its Ray actor is gone)"
        except self.ray.exceptions.RayError as exc:  # the worker main raised: say what
            return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.places.values()]

    def terminate(self, grace_s: float = 3.0) -> None:
        """Let the ranks finish (after rank 0's STOP their main returns), then kill the
        actors and remove the placement group if it reserved it; idempotent."""
        if self._removed or not self.ray.is_initialized():
            return
        self._removed = True
        refs = list(self.runs.values())
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        if self.owns_group:
            self.ray.util.remove_placement_group(self.pg)


def _connect():
    """The Ray this process already joined, else the router's way in ($RAY_ADDRESS, a
    cluster started here with `ray start`, else a local instance)."""
    from servelm.launch.ray_cluster import connect, import_ray

    ray = import_ray()
    return ray if ray.is_initialized() else connect(None)


def _bundles(world: int, cpus: int, gpu: bool) -> list[dict]:
    one = {"GPU": 1.0} if gpu else {"CPU": float(cpus)}
    return [dict(one) for _ in range(world)]


def _pinned_group(ray, bundles: list[dict], strategy: str, name: str):
    """A placement group of `bundles` whose bundle 0 is on this process's Ray node."""
    import inspect

    from ray.util.placement_group import placement_group

    if "bundle_label_selector" in inspect.signature(placement_group).parameters:
        here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
        return placement_group(bundles, strategy=strategy, name=name,
                               bundle_label_selector=[here] + [{}] * (len(bundles) - 1))
    node = f"node:{ray.util.get_node_ip_address()}"
    bundles = [{**bundles[0], node: NODE_RESOURCE_SLIVER}, *bundles[1:]]
    return placement_group(bundles, strategy=strategy, name=name)


def _reserve(ray, args: EngineArgs, bundles: list[dict]):
    pg = _pinned_group(ray, bundles, args.parallel_placement,
                       f"servelm-{os.getpid()}-{time.monotonic_ns()}")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)  # read here: tests lower it
    if not ready:
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"parallel_launcher ray: the cluster did not place {len(bundles)} bundles "
            f"{bundles[-1]} (parallel_placement {args.parallel_placement}) in "
            f"{PLACEMENT_TIMEOUT_S:g} s; it has {ray.cluster_resources()}")
    return pg


def _given_group(ray, group_id: str, world: int):
    """(group, its bundles): the placement group the router's Ray backend reserved for this
    replica ($SERVELM_RAY_PLACEMENT_GROUP), checked: one bundle per rank, bundle 0 on this
    process's node (the replica's actor holds it and started this process)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table

    pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group_id)))
    table = placement_group_table(pg)
    if table.get("state") not in ("CREATED", "REMOVED", None):  # still being placed
        ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        table = placement_group_table(pg)
    if table.get("state") != "CREATED":
        raise PlacementError(f"parallel_launcher ray: ${PLACEMENT_GROUP_ENV} names placement "
                             f"group {group_id}, which is {table.get('state', 'unknown')}")
    bundles = [table["bundles"][i] for i in sorted(table["bundles"])]
    if len(bundles) != world:
        raise PlacementError(f"parallel_launcher ray: placement group {group_id} has "
                             f"{len(bundles)} bundles for {world} ranks")
    here = ray.get_runtime_context().get_node_id()
    if table["bundles_to_node_id"].get(0) != here:
        raise PlacementError(f"parallel_launcher ray: bundle 0 of placement group {group_id} "
                             f"is on node {table['bundles_to_node_id'].get(0)}, not on rank "
                             f"0's node {here}")
    return pg, bundles


def _start_actors(ray, pg, bundles: list[dict], build: Callable) -> dict:
    """Ranks 1.. as WorkerActors, each holding all of its bundle (its CPUs or its GPU)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(WorkerActor)
    return {rank: cls.options(
        num_cpus=bundles[rank].get("CPU", 0.0), num_gpus=bundles[rank].get("GPU", 0.0),
        max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank)).remote(build)
        for rank in range(1, len(bundles))}


def _rank0_gpu(places: dict, here: str) -> str:
    """The first GPU of this node no worker actor here was given (Ray hands the actors
    their GPUs; rank 0 is no actor, so it takes one Ray did not)."""
    taken = {g for p in places.values() if p.node_id == here for g in p.gpus}
    free = [i for i in range(torch.cuda.device_count()) if i not in taken]
    if not free:
        raise RuntimeError(f"parallel_launcher ray: no GPU left on {here} for rank 0")
    return f"cuda:{free[0]}"


def start_workers(args: EngineArgs, main: RankMain) -> tuple[EngineArgs, ParallelGroup]:
    """Reserve the placement group (or take the one the router's Ray backend reserved),
    start ranks 1..N-1 in it (main.build builds each shard), join as rank 0. Returns rank
    0's EngineArgs (its share of the threads, its GPU) and its group, `.workers` set."""
    ray = _connect()
    parallel = args.parallel_config()
    world, gpu = parallel.world_size, torch.device(args.device).type == "cuda"
    threads, _ = split_cpus(args, world)
    rank_args = dataclasses.replace(args, num_threads=threads)
    given = os.environ.get(PLACEMENT_GROUP_ENV)
    if given:
        pg, bundles = _given_group(ray, given, world)
    else:
        bundles = _bundles(world, threads, gpu)
        pg = _reserve(ray, args, bundles)
    actors = _start_actors(ray, pg, bundles, main.build)
    workers = RayWorkerSet(ray, pg, actors, {}, {}, owns_group=not given)
    try:
        wheres = [_place_decoder.decode(b) for b in ray.get(
            [a.where.remote() for a in actors.values()], timeout=JOIN_TIMEOUT_S)]
        workers.places = dict(zip(actors, wheres))
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        for rank, actor in actors.items():
            spec = WorkerStart(dataclasses.replace(rank_args, device="cuda:0" if gpu else
                                                   args.device), rank, host, port, -1, [],
                               JOIN_TIMEOUT_S)
            workers.runs[rank] = actor.run.remote(codec.encode(spec))
        logger.info("model parallel over Ray: %d ranks in placement group %s (%s), %d "
                    "threads each, workers %s", world, pg.id.hex(),
                    "the replica's, from the router" if given else args.parallel_placement,
                    threads, [(p.node, p.node_id[:12], p.pid) for p in wheres])
        here = ray.get_runtime_context().get_node_id()
        # in the router's group the replica's actor holds bundle 0's GPU, and this process
        # (its child) sees only that one (Ray's CUDA_VISIBLE_DEVICES): cuda:0
        device = torch.device(args.device if not gpu else "cuda:0" if given else
                              _rank0_gpu(workers.places, here))
        if gpu:
            rank_args = dataclasses.replace(rank_args, device=str(device))
        group = ParallelGroup.join(0, parallel, device, host, port, JOIN_TIMEOUT_S)
    except BaseException:
        workers.terminate(grace_s=0.0)
        raise
    group.workers = workers
    return rank_args, group
