"""The autoscaling controller of a live router: the policy's decisions carried out on the
router's ReplicaSet through a backend that starts and stops replicas (Ray actors:
servelm/router/ray_backend.py).

Owns: the loop (every `config.tick_s`: the signal from the router's own count of tokens in
flight, `Autoscaler.decide`, then the change), starting replicas in the background (they
count as booting until they answer /health, then the router routes to them), and removing
them drained: the router stops sending them requests, their in-flight requests finish (up to
`config.drain_timeout_s`), then the backend stops them.
Never: places a replica (the backend does: Ray), decides a size (policy.py does), or drops a
request: a replica leaves the router only once nothing is in flight there, or its drain
timed out (then the replica's own SIGTERM drain still finishes what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from servelm.autoscale.policy import AutoscaleConfig, AutoscaleConfigError, Autoscaler

logger = logging.getLogger(__name__)


class ReplicaBackend(Protocol):
    async def start_replica(self) -> tuple[Any, str]:
        """Start one replica; (its handle, its URL) once it answers /health."""

    async def stop_replica(self, handle: Any) -> None:
        """Stop a replica that has nothing in flight."""


def check_controller_config(config: AutoscaleConfig) -> None:
    if config.signal != "tokens_in_flight":
        raise AutoscaleConfigError(
            f"signal: the router's controller scales on tokens_in_flight (the other signals "
            f"are for comparing in `servelm sim`), got {config.signal!r}")


class AutoscaleController:
    def __init__(self, config: AutoscaleConfig, backend: ReplicaBackend,
                 handles: dict[str, Any], clock: Callable[[], float] = time.monotonic):
        check_controller_config(config)
        self.config = config
        self.backend = backend
        self.handles = dict(handles)  # url -> backend handle, of the replicas in the router
        self.scaler = Autoscaler(config, clock)
        self._jobs: set[asyncio.Task] = set()
        self.num_booting = 0

    async def __call__(self, replicas) -> None:
        """Run until cancelled (ReplicaSet.controllers: started with the probe loop)."""
        if self.config.min_replicas == 0:  # scale to zero: the router holds, not refuses
            replicas.hold_timeout_s = self.config.hold_timeout_s
        try:
            while True:
                await asyncio.sleep(self.config.tick_s)
                self.tick(replicas)
        finally:
            for job in list(self._jobs):
                job.cancel()

    def tick(self, replicas) -> None:
        serving = replicas.healthy
        decision = self.scaler.decide(replicas.tokens_in_flight(), len(serving),
                                      self.num_booting)
        if decision.delta > 0:
            replicas.num_scale_ups += 1
            logger.warning("autoscale: %d -> %d replicas (load %.2f of the target)",
                           len(serving) + self.num_booting, decision.num_replicas,
                           decision.load)
            for _ in range(decision.delta):
                self._spawn(self._add(replicas))
        elif decision.delta < 0:
            # Booting replicas cannot be called back: drain serving ones, keeping one unless
            # the policy scales to zero.
            keep = 1 if self.config.min_replicas >= 1 else 0
            victims = sorted(serving, key=lambda r: r.tokens_in_flight)
            victims = victims[:min(-decision.delta, len(serving) - keep)]
            if victims:
                replicas.num_scale_downs += 1
                logger.warning("autoscale: %d -> %d replicas (load %.2f of the target)",
                               len(serving) + self.num_booting,
                               len(serving) + self.num_booting - len(victims), decision.load)
            for rep in victims:
                replicas.drain(rep)
                self._spawn(self._remove(replicas, rep))
        replicas.num_booting = self.num_booting

    def _spawn(self, coro) -> None:
        job = asyncio.get_running_loop().create_task(coro)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _add(self, replicas) -> None:
        self.num_booting += 1
        replicas.num_booting = self.num_booting
        try:
            handle, url = await self.backend.start_replica()
        except Exception as exc:  # noqa: BLE001 - a replica that fails to start is logged
            logger.error("autoscale: a replica failed to start: %s: %s",
                         type(exc).__name__, exc)
            return
        finally:
            self.num_booting -= 1
            replicas.num_booting = self.num_booting
        self.handles[url] = handle
        replicas.add(url)

    async def _remove(self, replicas, rep) -> None:
        if not await replicas.drained(rep, self.config.drain_timeout_s):
            logger.warning("autoscale: %s still has %d requests after %g s; stopping it (it "
                           "drains them itself on SIGTERM)", rep.url, rep.num_in_flight,
                           self.config.drain_timeout_s)
        replicas.remove(rep)
        handle = self.handles.pop(rep.url, None)
        if handle is not None:
            await self.backend.stop_replica(handle)


__all__ = ["AutoscaleController", "ReplicaBackend", "check_controller_config"]
