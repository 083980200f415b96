"""Workers started elsewhere (as torchrun would on another machine): rank 0 with
--parallel-master waits at HOST:PORT, a worker started with torchrun's environment
variables and the same engine flags joins it, and the replica serves as one started here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from parallel_helpers import build, run_greedy, save_tiny


def test_a_worker_started_by_environment_variables_joins_rank_0(tmp_path):
    path = save_tiny("llama", tmp_path)
    ref_tokens, _ = run_greedy(build(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "LOCAL_RANK": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "servelm.parallel.worker", "--from-env",
                               path, "--tensor-parallel-size", "2", "--block-size", "4"],
                              env=env)
    try:
        engine = build(path, tensor_parallel_size=2, parallel_master=f"127.0.0.1:{port}")
        assert engine.runner.workers.procs == {}  # nothing spawned here
        tokens, _ = run_greedy(engine)
        engine.runner.close()  # tells the worker to stop
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert tokens == ref_tokens
