"""ParallelRunner: the Runner the scheduler sees when a replica has several ranks.

Owns: rank 0's side of every step: the StepDescription, encoded by the contract's codec
(servelm/core/codec.py, never pickle), broadcast to every worker, then run on rank 0's own
shard; rank 0's StepResult is the replica's (every rank computes the same logits: the head's
all-gather gives each the full vocabulary). Never: schedules, or runs a step another rank
has not been sent.

A worker that dies fails the replica: a collective in flight raises on rank 0 (gloo: the
peer's socket closes), a death between steps is seen before the next broadcast. Either way
execute raises WorkerDiedError naming the rank and how it ended, the surviving workers are
stopped, and the engine loop fails every request it holds (servelm/engine/engine_loop.py).
"""

from __future__ import annotations

import logging
import threading
import time

from servelm.core import codec
from servelm.core.contract import StepDescription, StepResult
from servelm.protocol import InvalidParameterError

logger = logging.getLogger(__name__)

STEP, STOP = 1, 0  # the broadcast's message kinds (group.broadcast_bytes)


class WorkerDiedError(RuntimeError):
    """A model-parallel worker of this replica is gone; the replica cannot step."""


class ParallelRunner:
    """Runner protocol over rank 0's ModelRunner and the worker processes."""

    def __init__(self, local, group, workers):
        self.local = local  # rank 0's ModelRunner
        self.group = group  # servelm.parallel.group.ParallelGroup
        self.workers = workers  # servelm.parallel.launcher.WorkerSet
        self.state = local.state
        self.config = local.config
        self.model = local.model
        self.kv_cache = local.kv_cache
        self.backend = local.backend
        self.cpu_stack = local.cpu_stack  # rank 0's (servelm/parallel/decode_stack.py)
        self._closed = False

    def execute(self, step: StepDescription) -> StepResult:
        if step.kv_saves or step.kv_loads:
            raise InvalidParameterError("moving KV blocks (offload, disaggregation) is not "
                                        "supported with tensor_parallel_size > 1: each rank "
                                        "holds a share of every block",
                                        param="tensor_parallel_size")
        self._check_workers()
        try:
            self.group.broadcast_bytes(STEP, codec.encode(step))
            return self.local.execute(step)
        except Exception as exc:
            # The ranks are out of step now: the replica is done. A failed collective means
            # a peer went away; say which one.
            dead = self.workers.wait_for_death(timeout_s=2.0 if isinstance(
                exc, RuntimeError) else 0.0)
            self._stop()
            if dead:
                raise WorkerDiedError(f"step failed: {dead}") from exc
            raise

    def _check_workers(self) -> None:
        dead = self.workers.dead()
        if dead:
            self._stop()
            raise WorkerDiedError(f"cannot step: {dead}")

    def _stop(self) -> None:
        self._closed = True  # the watcher stops: whoever called this reports the failure
        self.workers.terminate()
        self.group.leave()

    def watch_workers(self, on_death, every_s: float = 0.2) -> None:
        """Call on_death(cause) once if a worker dies, also while no step runs (the engine
        core reports the replica dead at once instead of at its next step)."""
        def watch() -> None:
            while not self._closed:
                dead = self.workers.dead()
                if dead:
                    on_death(f"model-parallel {dead}")
                    return
                time.sleep(every_s)

        threading.Thread(target=watch, name="servelm-worker-watch", daemon=True).start()

    def score(self, items):
        raise InvalidParameterError("scoring outside a step is not supported with "
                                    "tensor_parallel_size > 1 (ask for prompt_logprobs)",
                                    param="tensor_parallel_size")

    def close(self) -> None:
        """Tell the workers to stop, then make sure they did."""
        self._closed = True
        if not self.workers.dead():
            try:
                self.group.broadcast_bytes(STOP)
            except RuntimeError:
                pass
        self._stop()
