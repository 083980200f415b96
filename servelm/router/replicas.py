"""The replicas behind a router: their health and load, learnt by probing them.

Owns: `Replica` (a URL, its health, the load it last reported on /metrics, and the router's
own count of what it sent there and has not seen finish) and `ReplicaSet` (the probe loop:
/health and /metrics every `probe_interval` seconds; a replica that fails `eject_after`
probes in a row, or a request, is ejected; the first probe it answers puts it back; replicas
added, drained (no new requests; those in flight finish) and removed while it runs; the
background tasks of a controller, started and stopped with the probe loop).
Never: decides where a request goes (policies.py does, from `ReplicaSet.loads()`).

Load = what the replica reported (waiting and running requests, KV usage; up to one probe
old) + the tokens the router has in flight there (prompt + max_tokens of each request sent
and not finished: current to the request, so a burst between two probes is still spread).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import httpx

from servelm.engine.prefix_cache import STORED
from servelm.router.policies import ReplicaLoad

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^(servelm_[a-z_]+) (\S+)$", re.M)


def parse_load_metrics(text: str) -> dict[str, float]:
    """The unlabelled servelm_* samples of a Prometheus text page."""
    return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(text)}


@dataclass
class Replica:
    url: str
    is_healthy: bool = True
    num_failures: int = 0  # consecutive failed probes or requests
    num_ejections: int = 0
    reported_waiting: int = 0
    reported_running: int = 0
    reported_kv_usage: float = 0.0
    reported_cached_tokens: float = 0.0  # servelm_prefix_cache_hit_tokens_total
    reported_prompt_tokens: float = 0.0  # servelm_prompt_tokens_total
    tokens_in_flight: int = 0  # router's own count
    num_in_flight: int = 0
    num_routed: int = 0
    last_probe: float = 0.0
    # The replica's prefix cache as its KV events describe it: chain hashes of the blocks.
    cache_view: set = field(default_factory=set)
    kv_next: int = 0  # the next event number to ask for
    block_size: int = 0  # 0: the replica publishes no events
    num_view_resets: int = 0
    is_draining: bool = False  # being removed: no new requests, those in flight finish

    @property
    def is_serving(self) -> bool:
        return self.is_healthy and not self.is_draining

    def load(self, cached_tokens: int = 0) -> ReplicaLoad:
        return ReplicaLoad(self.reported_waiting, max(self.reported_running, self.num_in_flight),
                           self.tokens_in_flight, self.reported_kv_usage, self.is_serving,
                           cached_tokens, self.num_in_flight, self.num_routed)

    def cached_tokens(self, hashes: list[int]) -> int:
        """Tokens of a prompt (its blocks' chain hashes) this replica is expected to hold."""
        n = 0
        for h in hashes:
            if h not in self.cache_view:
                break
            n += 1
        return n * self.block_size

    def apply_kv_events(self, page: dict) -> None:
        if page.get("reset"):
            self.cache_view.clear()
            self.num_view_resets += 1
        for kind, h, _parent in page.get("events", []):
            if kind == STORED:
                self.cache_view.add(h)
            else:
                self.cache_view.discard(h)
        self.kv_next = int(page.get("next", self.kv_next))
        self.block_size = int(page.get("block_size", self.block_size))


class ReplicaSet:
    def __init__(self, urls: list[str], probe_interval: float = 1.0, eject_after: int = 2,
                 probe_timeout: float = 1.0, api_key: str | None = None):
        if not urls:
            raise ValueError("at least one --replica URL is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.probe_interval = probe_interval
        self.eject_after = eject_after
        self.probe_timeout = probe_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.controllers: list = []  # async callables(ReplicaSet), run beside the probe loop
        # What an autoscaling controller reports (the router's /metrics shows it).
        self.num_booting = 0
        self.num_scale_ups = 0
        self.num_scale_downs = 0
        self.on_change = None  # called with (replica, is_healthy) on ejection / readmission
        # Scale to zero: with no replica serving, the router holds a request up to
        # hold_timeout_s (None: answers 503 at once) and counts its work here meanwhile.
        self.hold_timeout_s: float | None = None
        self.held_tokens = 0
        self.num_held = 0

    def loads(self) -> list[ReplicaLoad]:
        return [r.load() for r in self.replicas]

    @property
    def healthy(self) -> list[Replica]:
        """The replicas a request may go to: healthy and not draining."""
        return [r for r in self.replicas if r.is_serving]

    def tokens_in_flight(self) -> int:
        """The autoscaling signal: the work in flight on the serving replicas (uncached prompt
        tokens + max_tokens of each request sent there and not finished), and that of the
        requests the router holds while it has no replica (scale to zero)."""
        return sum(r.tokens_in_flight for r in self.healthy) + self.held_tokens

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str) -> Replica:
        """A new replica, routed to from now on (it answered /health: the caller waited)."""
        rep = Replica(url.rstrip("/"))
        self.replicas.append(rep)
        logger.warning("router: added %s", rep.url)
        return rep

    def drain(self, replica: Replica) -> None:
        """No new requests to `replica`; those in flight finish (see `drained`)."""
        replica.is_draining = True
        logger.warning("router: draining %s (%d requests in flight)", replica.url,
                       replica.num_in_flight)

    async def drained(self, replica: Replica, timeout: float, poll: float = 0.1) -> bool:
        """Wait until the draining replica has nothing in flight (False: timed out)."""
        deadline = time.monotonic() + timeout
        while replica.num_in_flight > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(poll)
        return True

    def remove(self, replica: Replica) -> None:
        self.replicas.remove(replica)
        logger.warning("router: removed %s", replica.url)

    # -- health ----------------------------------------------------------------------------

    def record_failure(self, replica: Replica, why: str) -> None:
        replica.num_failures += 1
        if replica.is_healthy and replica.num_failures >= self.eject_after:
            replica.is_healthy = False
            replica.num_ejections += 1
            logger.warning("router: ejected %s (%s)", replica.url, why)
            if self.on_change:
                self.on_change(replica, False)

    def record_success(self, replica: Replica) -> None:
        replica.num_failures = 0
        if not replica.is_healthy:
            replica.is_healthy = True
            logger.warning("router: readmitted %s", replica.url)
            if self.on_change:
                self.on_change(replica, True)

    async def probe(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            health = await client.get(replica.url + "/health", timeout=self.probe_timeout,
                                      headers=self.headers)
            if health.status_code != 200:
                raise httpx.HTTPStatusError(f"health {health.status_code}",
                                            request=health.request, response=health)
            page = await client.get(replica.url + "/metrics", timeout=self.probe_timeout,
                                    headers=self.headers)
        except httpx.HTTPError as exc:
            self.record_failure(replica, f"probe: {exc!r}")
            return
        m = parse_load_metrics(page.text) if page.status_code == 200 else {}
        replica.reported_waiting = int(m.get("servelm_num_requests_waiting", 0))
        replica.reported_running = int(m.get("servelm_num_requests_running", 0))
        replica.reported_kv_usage = m.get("servelm_kv_cache_usage_ratio", 0.0)
        replica.reported_cached_tokens = m.get("servelm_prefix_cache_hit_tokens_total", 0.0)
        replica.reported_prompt_tokens = m.get("servelm_prompt_tokens_total", 0.0)
        replica.last_probe = time.monotonic()
        self.record_success(replica)
        await self.pull_kv_events(client, replica)

    async def pull_kv_events(self, client: httpx.AsyncClient, replica: Replica) -> None:
        """Bring the replica's cache view up to date (pages of events until caught up)."""
        for _ in range(20):
            try:
                r = await client.get(replica.url + "/v1/kv_events", timeout=self.probe_timeout,
                                     params={"after": replica.kv_next}, headers=self.headers)
            except httpx.HTTPError:
                return  # the next probe tries again
            if r.status_code != 200:
                return  # not a servelm replica, or an older one: no cache view
            page = r.json()
            before = replica.kv_next
            replica.apply_kv_events(page)
            if not page.get("events") or replica.kv_next == before:
                return

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.probe(client, r) for r in list(self.replicas)))

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._probe_loop())
        self._tasks = [loop.create_task(c(self)) for c in self.controllers]

    async def stop(self) -> None:
        for task in [*self._tasks, self._task]:
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _probe_loop(self) -> None:
        async with httpx.AsyncClient() as client:
            while True:
                await self.probe_all(client)
                await asyncio.sleep(self.probe_interval)


__all__ = ["Replica", "ReplicaSet", "parse_load_metrics"]
