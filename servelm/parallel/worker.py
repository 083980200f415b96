"""A model-parallel worker process: one rank of a replica, driven by rank 0's broadcasts.

Owns: reading the WorkerStart frame (stdin), dying with its parent, joining the group,
building this rank's shard with the `build` it is given (the engine builder's build_engine,
the same code as rank 0), and the loop: receive a step, decode it with the contract's codec,
run it on the local ModelRunner, drop the result (rank 0's is the replica's). Never:
schedules, talks to a front end, keeps running once rank 0 is gone (a broadcast from a dead
peer raises; the parent's death also ends it), or imports the engine builder (it sits above
this package: the process's entry, servelm/core_process/worker.py, hands it over).

Run as `python -m servelm.core_process.worker` by servelm/parallel/launcher.py (a
WorkerStart frame on stdin), or on another machine as

    RANK=r WORLD_SIZE=n MASTER_ADDR=host MASTER_PORT=port [LOCAL_RANK=i] \
        python -m servelm.core_process.worker --from-env MODEL [engine flags]

(torchrun's variables; the same engine flags as rank 0's `servelm serve`, whose
--parallel-master is host:port): it then joins rank 0 there and serves until rank 0 goes.
With --parallel-launcher ray a Ray actor calls `run` with its WorkerStart instead.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

from servelm.core import codec


def _die_with_parent(parent_pid: int) -> None:
    """Exit once the parent is gone, however it ended (a thread watching the parent pid:
    prctl's PDEATHSIG would fire when the parent's *thread* that spawned us ends, and an
    engine may be built on a thread that does not outlive the build)."""
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="servelm-parent-watch", daemon=True).start()


def read_spec() -> codec.WorkerStart:
    data = sys.stdin.buffer.read()
    header = data[:codec.HEADER_BYTES]
    body = data[codec.HEADER_BYTES:codec.HEADER_BYTES + codec.frame_length(header)]
    return codec.worker_start_decoder.decode(body)


def serve_steps(group, runner) -> None:
    """Run every step rank 0 broadcasts until it says stop."""
    from servelm.parallel.runner import STEP, STOP

    while True:
        kind, payload = group.receive_bytes()
        if kind == STOP:
            return
        if kind != STEP:
            raise codec.CodecError(f"unknown worker message kind {kind}")
        runner.execute(codec.step_decoder.decode(payload))


def spec_from_env(argv: list[str]) -> codec.WorkerStart:
    """The WorkerStart of a worker started by torchrun (or by hand): RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (and LOCAL_RANK: the GPU) and the engine flags in argv."""
    import argparse
    import dataclasses

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    p = argparse.ArgumentParser(prog="python -m servelm.core_process.worker --from-env")
    p.add_argument("model")
    add_engine_cli_args(p)
    args = engine_args_from_cli(p.parse_args(argv))
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise SystemExit(f"--from-env: {', '.join(missing)} not set")
    world = args.parallel_config().world_size
    if int(env["WORLD_SIZE"]) != world:
        raise SystemExit(f"WORLD_SIZE {env['WORLD_SIZE']} is not tensor x pipeline parallel "
                         f"size {world}")
    if args.device.startswith("cuda"):
        args = dataclasses.replace(args, device=f"cuda:{env.get('LOCAL_RANK', '0')}")
    return codec.WorkerStart(args, int(env["RANK"]), env["MASTER_ADDR"],
                             int(env["MASTER_PORT"]), parent_pid=-1)


def main(argv: list[str] | None, build: Callable) -> int:
    """The rank's process: its WorkerStart from argv (--from-env) or stdin, then `run`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--from-env"]:
        spec = spec_from_env(argv[1:])
    else:
        spec = read_spec()
        _die_with_parent(spec.parent_pid)
    return run(spec, build)


def run(spec: codec.WorkerStart, build: Callable) -> int:
    """Be rank spec.rank until rank 0 stops (0) or goes away (1); build(args, parallel=group)
    returns this rank's engine shard. Also what a Ray actor runs
    (servelm/parallel/ray_launcher.py)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[servelm worker rank {spec.rank} %(process)d] %(message)s")
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    import torch

    from servelm.parallel.group import ParallelGroup

    args = spec.engine_args
    group = ParallelGroup.join(spec.rank, args.parallel_config(), torch.device(args.device),
                               spec.master_addr, spec.master_port, spec.timeout_s)
    engine = build(args, parallel=group)
    try:
        serve_steps(group, engine.runner)
    except Exception:  # rank 0 is gone or sent garbage: nothing to serve any more
        logging.getLogger("servelm.parallel").exception("worker rank %d stops", spec.rank)
        return 1
    group.leave()
    return 0

