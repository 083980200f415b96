"""A model-parallel worker process: one rank of a replica, driven by rank 0's broadcasts.

Owns: reading the WorkerStart frame (stdin), dying with its parent, joining the group,
building this rank's shard of the engine (servelm/engine_builder.py, the same code as rank
0), and the loop: receive a step, decode it with the contract's codec, run it on the local
ModelRunner, drop the result (rank 0's is the replica's). Never: schedules, talks to a front
end, or keeps running once rank 0 is gone (a broadcast from a dead peer raises; the parent's
death also ends it).

Run as `python -m servelm.parallel.worker` by servelm/parallel/launcher.py.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

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


def main() -> int:
    spec = read_spec()
    _die_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[servelm worker rank {spec.rank} %(process)d] %(message)s")
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    import torch

    from servelm.engine_builder import build_engine
    from servelm.parallel.group import ParallelGroup

    args = spec.engine_args
    group = ParallelGroup.join(spec.rank, args.parallel_config(), torch.device(args.device),
                               spec.master_addr, spec.master_port, spec.timeout_s)
    engine = build_engine(args, parallel=group)
    try:
        serve_steps(group, engine.runner)
    except Exception:  # rank 0 is gone or sent garbage: nothing to serve any more
        logging.getLogger("servelm.parallel").exception("worker rank %d stops", spec.rank)
        return 1
    group.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
