"""Starting a replica's worker processes and keeping track of them.

Owns: rank 0's `start_workers` (one `python -m <RankMain.module>` per other rank, a
ProcessSpec started by the launcher's Supervisor (servelm/launch/), each told its place by a
codec WorkerStart frame on its stdin; on the CPU the cores are split
between the ranks, each pinned to its own), joining the group as rank 0, and `WorkerSet`
(who is alive, how a dead one ended, stopping the rest: no orphan survives rank 0, which
stops them at exit, and each worker also dies with its parent). Never: builds a model, or
names the rank's entry itself (the engine builder, above this package, gives its RankMain).

Across machines: `--parallel-launcher ray` places the ranks with a Ray placement group
(servelm/parallel/ray_launcher.py), or they are started by torchrun-style environment
variables and join rank 0 at --parallel-master (docs/parallel.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Callable

import torch

from servelm.config import EngineArgs
from servelm.core import codec
from servelm.core.codec import WorkerStart
from servelm.launch import ProcessHandle, ProcessSpec, Supervisor
from servelm.parallel.group import ParallelGroup
from servelm.protocol import InvalidParameterError

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # joining, and every collective after: a hung rank fails the rest


def check_supported(args: EngineArgs) -> None:
    """Refuse, by name, what the parallel runner does not do yet."""
    p = args.parallel_config()
    refused = {
        "speculative_method": args.speculative_method is not None,
        "lora": args.is_lora_enabled,
        "deterministic": args.deterministic,
        "cuda_graphs": args.cuda_graphs,
        # each rank holds a share of every KV block: moving blocks needs every rank's part
        "kv_host_memory_gb": getattr(args, "kv_tiers_config", None) is not None
        and args.kv_tiers_config().is_enabled,
    }
    for name, on in refused.items():
        if on:
            raise InvalidParameterError(
                f"{name} is not supported with model parallelism (tensor_parallel_size "
                f"{p.tensor_parallel_size}, pipeline_parallel_size "
                f"{p.pipeline_parallel_size}); docs/parallel.md lists what is", param=name)


class WorkerSet:
    """Ranks 1..N-1 as child processes, each a ProcessHandle of the launcher's Supervisor."""

    def __init__(self, procs: dict[int, ProcessHandle], supervisor: Supervisor | None = None):
        self.procs = procs
        self.supervisor = supervisor
        self._logged: set[int] = set()
        atexit.register(self.terminate)

    def dead(self) -> str:
        """'' while every worker runs, else which ones ended and how (their last stderr
        lines go to the log, once: the message itself reaches API clients)."""
        out = []
        for rank, handle in self.procs.items():
            death = handle.death()
            if death is not None:
                out.append(death.describe(num_lines=0))
                if rank not in self._logged and not handle.is_stopping:
                    self._logged.add(rank)
                    logger.error("%s", death.describe())
        return "; ".join(out)

    def wait_for_death(self, timeout_s: float) -> str:
        """A failed collective means a peer went away: give the kernel a moment to show it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                return dead
            time.sleep(0.05)
        return ""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def terminate(self, grace_s: float = 3.0) -> None:
        if self.supervisor is not None:
            self.supervisor.stop_all(grace_s, list(self.procs.values()))


@dataclasses.dataclass(frozen=True)
class RankMain:
    """What ranks 1..N-1 run, given by the assembly that builds engines (this package sits
    below it: a rank building its shard must not import it).

    module: run as `python -m module` with the WorkerStart frame on its stdin (the process
            launcher's children; servelm/core_process/worker.py)
    build:  build_engine(args, parallel=group) -> the rank's engine, which a Ray actor rank
            calls in its own process (servelm/parallel/worker.py run)"""

    module: str
    build: Callable


def worker_spec(start: WorkerStart, main: RankMain) -> ProcessSpec:
    """One rank as a child process: its WorkerStart frame on stdin, ready once started (rank
    0's join of the group is the wait, with its own deadline)."""
    return ProcessSpec(f"worker rank {start.rank}", (sys.executable, "-m", main.module),
                       config=codec.frame(start))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cpus(args: EngineArgs, world: int) -> tuple[int, list[list[int]]]:
    """(torch threads per rank, the cores of each rank): the cores this process may use (or
    --threads of them) divided evenly; [] per rank when there are fewer cores than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    total = min(args.num_threads or len(cpus), len(cpus))
    per = max(1, total // world)
    if per * world > len(cpus):
        return per, [[] for _ in range(world)]
    return per, [cpus[r * per:(r + 1) * per] for r in range(world)]


def start_workers(args: EngineArgs, main: RankMain) -> tuple[EngineArgs, ParallelGroup]:
    """Start ranks 1..N-1 (running `main`) the way args.parallel_launcher names (LAUNCHERS),
    or wait for them at parallel_master; join the group as rank 0. Returns rank 0's
    EngineArgs (its share of the threads) and its group, with `.workers` set."""
    check_supported(args)
    if args.parallel_master is not None:
        if args.parallel_launcher != "process":
            raise InvalidParameterError(
                f"parallel_master: the workers are started elsewhere, but parallel_launcher "
                f"{args.parallel_launcher!r} starts them; give one of the two",
                param="parallel_master")
        return _join_external(args)
    return LAUNCHERS[args.parallel_launcher]()(args, main)


def _start_processes(args: EngineArgs, main: RankMain) -> tuple[EngineArgs, ParallelGroup]:
    """Ranks 1..N-1 as child processes of this one, on this machine."""
    parallel = args.parallel_config()
    device = torch.device(args.device)
    world = parallel.world_size
    threads, cpus = split_cpus(args, world)
    rank_args = dataclasses.replace(args, num_threads=threads)
    port = _free_port()
    specs = []
    for rank in range(1, world):
        dev = args.device if device.type != "cuda" else f"cuda:{rank}"
        start = WorkerStart(dataclasses.replace(rank_args, device=dev), rank, "127.0.0.1",
                            port, os.getpid(), cpus[rank] if device.type == "cpu" else [],
                            JOIN_TIMEOUT_S)
        specs.append(worker_spec(start, main))
    supervisor = Supervisor(stop_at_exit=False)
    handles = supervisor.start_all(specs, wait=False)
    workers = WorkerSet(dict(zip(range(1, world), handles)), supervisor)
    logger.info("model parallel: %d ranks (tensor %d x pipeline %d%s), %d threads each, "
                "workers %s", world, parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                ", expert parallel" if parallel.enable_expert_parallel else "", threads,
                workers.pids)
    if device.type == "cuda":
        rank_args = dataclasses.replace(rank_args, device="cuda:0")
        device = torch.device("cuda:0")
    try:
        group = ParallelGroup.join(0, parallel, device, "127.0.0.1", port, JOIN_TIMEOUT_S)
    except BaseException:
        workers.terminate()
        raise
    group.workers = workers
    return rank_args, group


def _ray_launcher():
    from servelm.parallel.ray_launcher import start_workers as start_on_ray

    return start_on_ray


# EngineArgs.parallel_launcher -> (a function returning) its start_workers; the names are
# servelm.config.PARALLEL_LAUNCHERS (torch-free, for --help)
LAUNCHERS = {"process": lambda: _start_processes, "ray": _ray_launcher}


def parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidParameterError(f"parallel_master must be HOST:PORT, got {text!r}",
                                    param="parallel_master")
    return host, int(port)


def _join_external(args: EngineArgs) -> tuple[EngineArgs, ParallelGroup]:
    """Rank 0 of workers started elsewhere: host the rendezvous at parallel_master (every
    interface), wait for them. Their deaths show as failed collectives (no process to poll)."""
    host, port = parse_master(args.parallel_master)
    device = torch.device("cuda:0" if torch.device(args.device).type == "cuda" else args.device)
    logger.info("model parallel: waiting for %d workers at %s:%d",
                args.parallel_config().world_size - 1, host, port)
    group = ParallelGroup.join(0, args.parallel_config(), device, host, port, JOIN_TIMEOUT_S)
    group.workers = WorkerSet({})
    return args, group
