"""Workers started elsewhere (as torchrun would on another machine): rank 0 with
--parallel-master waits at HOST:PORT, a worker started with torchrun's environment
variables and the same engine flags joins it, and the replica serves as one started here."""

from __future__ import annotations

import socket
import sys

from parallel_helpers import build, run_greedy, save_tiny

from servelm.launch import ProcessSpec, Resources, Supervisor, torchrun_env


def test_a_worker_started_by_environment_variables_joins_rank_0(tmp_path):
    path = save_tiny("llama", tmp_path)
    ref_tokens, _ = run_greedy(build(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the launcher's torchrun-style variant: the rank told its place by environment variables
    spec = ProcessSpec("external worker rank 1", (
        sys.executable, "-m", "servelm.core_process.worker", "--from-env", path,
        "--tensor-parallel-size", "2", "--block-size", "4"),
        resources=Resources(env=torchrun_env(1, 2, "127.0.0.1", port, local_rank=1)))
    supervisor = Supervisor(stop_at_exit=False)
    worker = supervisor.start(spec)
    try:
        engine = build(path, tensor_parallel_size=2, parallel_master=f"127.0.0.1:{port}")
        assert engine.runner.workers.procs == {}  # nothing spawned here
        tokens, _ = run_greedy(engine)
        engine.runner.close()  # tells the worker to stop
        assert worker.death(settle_s=30).returncode == 0
    finally:
        supervisor.stop_all(5.0)
    assert tokens == ref_tokens
