"""The autoscaling controller of a live router: the policy's decisions carried out on the
router's ReplicaSet through a backend that starts and stops replicas (Ray actors:
servelm/router/ray_backend.py).

Owns: the loop (every `config.tick_s`: the signal from the router's own count of tokens in
flight, with an SLO spec each class's goodput over the spec's window read from the
replicas' own gauges, `Autoscaler.decide`, then the change), starting replicas in the
background (they count as booting until they answer /health, then the router routes to
them), and removing them drained: the router stops sending them requests, their in-flight
requests finish (up to `config.drain_timeout_s`), then the backend stops them.

A fleet's goodput per class is the replicas' requests met over their requests finished in
the window, summed (`servelm_slo_window_met_requests` / `servelm_slo_window_requests`): one
replica with 9 of 10 met and one with 10 of 100 is 19 / 110 (17%), not a mean of ratios (50%).
The batch backlog is read from the same pages: each replica's lines pending
(`servelm_batch_requests_pending`), taken as due when the earliest of its batches' windows
closes (`servelm_batch_deadline_seconds`: an over-estimate when it holds two batches, never
an under-estimate), and the replicas' mean measured line rate (`servelm_batch_line_rate`),
for the policy's deadline demand (`BatchDemand`). A batch no replica has claimed yet is not
on any page: it counts once a replica holds it.
Never: places a replica (the backend does: Ray), decides a size (policy.py does), or drops a
request: a replica leaves the router only once nothing is in flight there, or its drain
timed out (then the replica's own SIGTERM drain still finishes what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import httpx

from servelm.autoscale.policy import (
    AutoscaleConfig,
    AutoscaleConfigError,
    Autoscaler,
    BatchBacklog,
    BatchDemand,
    Decision,
)

logger = logging.getLogger(__name__)


class ReplicaBackend(Protocol):
    async def start_replica(self) -> tuple[Any, str]:
        """Start one replica; (its handle, its URL) once it answers /health."""

    async def stop_replica(self, handle: Any) -> None:
        """Stop a replica that has nothing in flight."""


class ClassWindow(NamedTuple):
    """One replica's count of one SLO class over the spec's window (its gauges)."""

    num_met: int
    num_requests: int


_WINDOW_GAUGES = {"servelm_slo_window_met_requests": "met", "servelm_slo_window_requests": "all"}


def parse_slo_window(text: str) -> dict[str, ClassWindow]:
    """{class: ClassWindow} from a replica's /metrics page (prometheus_client's parser); a
    class with only one of the two gauges is left out (a page cut short, or a server too old
    to report the met count), and so is a page that does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                which, name = _WINDOW_GAUGES.get(sample.name), sample.labels.get("slo_class")
                if which and name is not None and math.isfinite(sample.value) \
                        and sample.value >= 0:
                    seen.setdefault(name, {})[which] = sample.value
    except ValueError as exc:
        logger.debug("autoscale: a /metrics page did not parse: %s", exc)
        return {}
    # The two gauges are read one after the other: a finish in between can make met one more
    return {name: ClassWindow(min(round(v["met"]), round(v["all"])), round(v["all"]))
            for name, v in seen.items() if len(v) == 2}


_BATCH_GAUGES = ("servelm_batch_requests_pending", "servelm_batch_deadline_seconds",
                 "servelm_batch_line_rate")


def parse_batch_demand(texts: Iterable[str]) -> BatchDemand | None:
    """The fleet's batch backlog from the replicas' /metrics pages: per replica its pending
    lines due at its earliest window, and the mean of the measured line rates; None when no
    replica holds a line (a page that does not parse counts nothing)."""
    from prometheus_client.parser import text_string_to_metric_families

    backlogs, rates = [], []
    for text in texts:
        seen: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in _BATCH_GAUGES and math.isfinite(sample.value):
                        seen[sample.name] = sample.value
        except ValueError:
            continue
        pending, deadline, rate = (seen.get(name) for name in _BATCH_GAUGES)
        if pending and pending > 0 and deadline is not None:
            backlogs.append(BatchBacklog(round(pending), deadline))
        if rate is not None and rate > 0:
            rates.append(rate)
    if not backlogs:
        return None
    return BatchDemand(tuple(backlogs), sum(rates) / len(rates) if rates else None)


def combine_goodput(names: Iterable[str],
                    windows: Iterable[dict[str, ClassWindow]]) -> dict[str, tuple]:
    """Each class's goodput over the fleet, as the policy reads it: {class: (met / requests,
    or None with none finished, requests)}, the counts summed over the replicas."""
    windows = list(windows)
    out = {}
    for name in names:
        met = sum(w[name].num_met for w in windows if name in w)
        n = sum(w[name].num_requests for w in windows if name in w)
        out[name] = (met / n if n else None, n)
    return out


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
        self.goodput: dict | None = None  # what the last tick passed to the policy
        self.batch: BatchDemand | None = None  # the batch backlog the last tick passed
        self.events: deque[Decision] = deque(maxlen=1000)  # the decisions carried out
        self._warned: set[str] = set()

    async def __call__(self, replicas) -> None:
        """Run until cancelled (ReplicaSet.controllers: started with the probe loop)."""
        if self.config.min_replicas == 0:  # scale to zero: the router holds, not refuses
            replicas.hold_timeout_s = self.config.hold_timeout_s
        try:
            async with httpx.AsyncClient() as client:
                while True:
                    await asyncio.sleep(self.config.tick_s)
                    goodput, batch = await self.read_replicas(replicas, client)
                    self.tick(replicas, goodput, batch)
        finally:
            for job in list(self._jobs):
                job.cancel()

    async def read_replicas(self, replicas,
                            client: httpx.AsyncClient) -> tuple[dict | None, BatchDemand | None]:
        """(each SLO class's goodput over the window, with an SLO spec; the batch backlog)
        from the /metrics of every replica that answers probes (draining ones too: what
        they finished in the window counts), each page read once."""
        reps = [r for r in replicas.replicas if r.is_healthy]
        pages = await asyncio.gather(*(self._read_page(replicas, client, r.url)
                                       for r in reps))
        read = [(r.url, page) for r, page in zip(reps, pages) if page is not None]
        goodput = None
        if self.scaler.slo is not None:
            goodput = combine_goodput(self.scaler.slo.names,
                                      [self._window(url, page) for url, page in read])
        return goodput, parse_batch_demand(page for _, page in read)

    async def read_goodput(self, replicas, client: httpx.AsyncClient) -> dict:
        """Each SLO class's goodput over the window (read_replicas, with an SLO spec)."""
        return (await self.read_replicas(replicas, client))[0]

    async def _read_page(self, replicas, client: httpx.AsyncClient, url: str) -> str | None:
        try:
            page = await client.get(url + "/metrics", timeout=replicas.probe_timeout,
                                    headers=replicas.headers)
        except httpx.HTTPError as exc:  # the probes eject it if it keeps failing
            logger.debug("autoscale: /metrics of %s not read: %r", url, exc)
            return None
        return page.text if page.status_code == 200 else None

    def _window(self, url: str, page: str) -> dict[str, ClassWindow]:
        window = parse_slo_window(page)
        missing = sorted(set(self.scaler.slo.names) - set(window))
        if missing and url not in self._warned:  # said once per replica
            self._warned.add(url)
            logger.warning("autoscale: %s reports no goodput window for SLO class(es) %s of "
                           "the policy's slo_spec (started without the same --slo-spec?); "
                           "they count nothing there", url, missing)
        return window

    def tick(self, replicas, goodput: dict | None = None,
             batch: BatchDemand | None = None) -> None:
        """goodput: {class: (goodput over the window or None, requests)}, with an SLO spec;
        batch: the fleet's batch backlog (read_replicas)."""
        serving = replicas.healthy
        self.goodput = goodput
        self.batch = batch
        decision = self.scaler.decide(replicas.tokens_in_flight(), len(serving),
                                      self.num_booting, goodput, batch)
        if decision.delta != 0:
            self.events.append(decision)
        if decision.delta > 0:
            replicas.num_scale_ups += 1
            logger.warning("autoscale: %d -> %d replicas (%s; load %.2f of the target)",
                           len(serving) + self.num_booting, decision.num_replicas,
                           decision.reason, decision.load)
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
                logger.warning("autoscale: %d -> %d replicas (%s; load %.2f of the target)",
                               len(serving) + self.num_booting,
                               len(serving) + self.num_booting - len(victims),
                               decision.reason, decision.load)
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


__all__ = ["AutoscaleController", "ClassWindow", "ReplicaBackend", "check_controller_config",
           "combine_goodput", "parse_batch_demand", "parse_slo_window"]
