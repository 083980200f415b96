"""Routing policies: pick a replica for a request from what is known of each replica's load.

Owns: `ReplicaLoad`, the registry of policies by name, and the defaults every picker reads:
`DEFAULT_POLICY` for the replica pick (`servelm router --policy`, `servelm serve
--router-policy`, `servelm sim --policy`, with `policy_help()` as their help) and
`WORKER_POLICY` for the disaggregation router's prefill and decode picks. A policy is an
object with `pick(loads, request) -> index`; it may keep state (round robin's cursor) but
never looks at a replica other than through its ReplicaLoad.
Never: imports torch, or talks to a replica (the caller learns the loads: a router from the
replicas' metrics and its own counts, the simulator from the simulated engines).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Protocol, Sequence


class ReplicaLoad(NamedTuple):
    num_waiting: int  # requests queued, not yet scheduled
    num_running: int  # requests with a running sequence
    num_tokens_in_flight: int  # tokens still to compute: waiting prompts + running remainder
    kv_usage: float  # share of KV blocks held, 0..1
    is_healthy: bool = True
    cached_tokens: int = 0  # of this request's prompt, expected in the replica's prefix cache
    num_in_flight: int = 0  # requests the caller sent there and has not seen finish
    num_routed: int = 0  # requests the caller ever sent there


class RouteRequest(NamedTuple):
    """What a policy knows of the request being placed."""

    num_tokens: int = 0  # prompt + max_tokens: what it adds to a replica's load
    user: str | None = None  # the session key (OpenAI `user`, or a session header)
    cache_key: str | None = None  # OpenAI `prompt_cache_key`: requests sharing a prefix


class RoutingPolicy(Protocol):
    name: str
    summary: str  # one line for the option's help

    def pick(self, loads: Sequence[ReplicaLoad], request: RouteRequest) -> int: ...


class RoundRobin:
    """Each healthy replica in turn, whatever its load."""

    name = "round_robin"
    summary = "each healthy replica in turn"
    reads_cached_tokens = False  # whether pick() looks at ReplicaLoad.cached_tokens

    def __init__(self):
        self._next = 0

    def pick(self, loads: Sequence[ReplicaLoad], request) -> int:
        n = len(loads)
        for k in range(n):
            i = (self._next + k) % n
            if loads[i].is_healthy:
                self._next = i + 1
                return i
        raise RuntimeError("no healthy replica")


class LeastLoaded:
    """The healthy replica with the fewest tokens in flight (ties: lower KV usage, then the
    lowest index), so a long prompt counts for what it will cost, not as one request."""

    name = "least_loaded"
    summary = "the fewest tokens in flight"
    reads_cached_tokens = False  # whether pick() looks at ReplicaLoad.cached_tokens

    def pick(self, loads: Sequence[ReplicaLoad], request) -> int:
        healthy = [i for i, load in enumerate(loads) if load.is_healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        return min(healthy, key=lambda i: (loads[i].num_tokens_in_flight, loads[i].kv_usage, i))

    def load_index(self, loads: Sequence[ReplicaLoad]) -> "LeastLoadedIndex":
        """An incremental form of pick over loads that change a few at a time."""
        return LeastLoadedIndex(loads)


class LeastLoadedIndex:
    """LeastLoaded.pick kept up to date as single replicas' loads change: a tournament tree
    over (tokens in flight, KV usage, index) of the healthy replicas, O(log n) per update
    and O(1) per pick, where pick over a list is O(n) (a simulator routes every arrival
    among hundreds of replicas, of which a few changed since the last one). pick() is
    LeastLoaded.pick over the loads given so far (tests/router: random updates)."""

    _NONE = (float("inf"), float("inf"), -1)  # an unhealthy replica, or padding

    def __init__(self, loads: Sequence[ReplicaLoad]):
        n = len(loads)
        size = 1
        while size < n:
            size *= 2
        self._size = size
        tree = [self._NONE] * (2 * size)
        for i, load in enumerate(loads):
            tree[size + i] = self._key(load, i)
        for j in range(size - 1, 0, -1):
            a, b = tree[2 * j], tree[2 * j + 1]
            tree[j] = a if a <= b else b
        self._tree = tree

    def _key(self, load: ReplicaLoad, i: int) -> tuple:
        if not load.is_healthy:
            return self._NONE
        return (load.num_tokens_in_flight, load.kv_usage, i)

    def update(self, i: int, load: ReplicaLoad) -> None:
        tree = self._tree
        j = self._size + i
        key = self._key(load, i)
        if tree[j] == key:
            return
        tree[j] = key
        j >>= 1
        while j:
            a, b = tree[2 * j], tree[2 * j + 1]
            best = a if a <= b else b
            if tree[j] == best:
                break  # nothing above changes
            tree[j] = best
            j >>= 1

    def pick(self) -> int:
        i = self._tree[1][2]
        if i < 0:
            raise RuntimeError("no healthy replica")
        return i

    def least(self) -> tuple:
        """The winning key, (tokens in flight, KV usage, index); index -1: none is healthy.
        Keys of disjoint sets of replicas compare as one set's would, once their indexes
        are mapped into one numbering in the same order (a sharded simulation's)."""
        return self._tree[1]


class Session:
    """Sticky: requests with the same `user` (or session id) go to the same healthy replica
    (rendezvous hashing: when a replica leaves, only its sessions move); requests without
    one are placed least-loaded."""

    name = "session"
    summary = "the same replica for the same user, else least_loaded"
    reads_cached_tokens = False  # whether pick() looks at ReplicaLoad.cached_tokens

    def __init__(self):
        self._fallback = LeastLoaded()

    def pick(self, loads: Sequence[ReplicaLoad], request: RouteRequest) -> int:
        key = request.user
        healthy = [i for i, load in enumerate(loads) if load.is_healthy]
        if not key or not healthy:
            return self._fallback.pick(loads, request)
        return max(healthy, key=lambda i: hashlib.sha256(f"{key}|{i}".encode()).digest())


class PrefixAffinity:
    """Cache affinity against load, with a bound on imbalance:

        score(r) = cached_tokens(r) - load_weight * tokens_in_flight(r)

    over the healthy replicas under the capacity C = (1 + epsilon) x the mean load once this
    request is placed: tokens_in_flight(r) < C = (1 + epsilon) * (sum of loads + request) / n
    (consistent hashing with bounded loads, in tokens rather than requests: a replica below
    capacity may take the request, so no replica ends above C by more than one request).
    The best score wins, ties to the least loaded. A request with a `prompt_cache_key` that
    no replica under capacity holds any of goes to the key's replica (rendezvous hashing).

    Defaults: epsilon 0.25 is the imbalance a fleet may show (max / mean <= 1.25); a cached
    prompt token saves a prefill token, while a token already in flight delays this request
    by less than one (decode tokens batch), so load_weight 0.5. Both are starting points,
    not yet tuned by a measured sweep."""

    name = "prefix_affinity"
    summary = "the longest cached prefix less a load penalty, within a bound on imbalance"
    reads_cached_tokens = True  # whether pick() looks at ReplicaLoad.cached_tokens

    def __init__(self, load_weight: float = 0.5, epsilon: float = 0.25):
        self.load_weight = load_weight
        self.epsilon = epsilon

    def pick(self, loads: Sequence[ReplicaLoad], request: RouteRequest) -> int:
        healthy = [i for i, load in enumerate(loads) if load.is_healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        total = sum(loads[i].num_tokens_in_flight for i in healthy) + request.num_tokens
        cap = (1 + self.epsilon) * total / len(healthy)
        fits = [i for i in healthy if loads[i].num_tokens_in_flight < cap]
        if not fits:
            return min(healthy, key=lambda i: (loads[i].num_tokens_in_flight, i))
        if request.cache_key and not any(loads[i].cached_tokens for i in fits):
            # No replica holds the prefix yet (or the router cannot see it: /v1/responses):
            # the key's own replica by rendezvous hashing, so the requests sharing it meet
            # where the first one caches it.
            return max(fits, key=lambda i: hashlib.sha256(
                f"{request.cache_key}|{i}".encode()).digest())
        return max(fits, key=lambda i: (loads[i].cached_tokens - self.load_weight
                                        * loads[i].num_tokens_in_flight,
                                        -loads[i].num_tokens_in_flight, -i))


class LeastBusy:
    """The healthy replica with the fewest requests the caller has open there (ties: the
    fewest ever sent there, then the lowest index): the disaggregation router's pick, whose
    workers' cost is a request each (a prefill worker holds one for a prompt, a decode
    worker for a completion) and which counts no tokens; the routed count spreads requests
    that come one at a time over an idle fleet."""

    name = "least_busy"
    summary = "the fewest requests in flight, ties to the fewest routed"
    reads_cached_tokens = False  # whether pick() looks at ReplicaLoad.cached_tokens

    def pick(self, loads: Sequence[ReplicaLoad], request) -> int:
        healthy = [i for i, load in enumerate(loads) if load.is_healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        return min(healthy, key=lambda i: (loads[i].num_in_flight, loads[i].num_routed, i))


_POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, Session, PrefixAffinity, LeastBusy)}

# The replica pick wherever one is made by option: the router, serve's data-parallel front
# and the simulator (which should route as the served fleet does). prefix_affinity places
# a request without a cache estimate by load, so it costs nothing where there is none, and
# it held 73.4% prefix-cache hits against least_loaded's 50.8% on multi-turn chat
# (docs/benchmarks.md).
DEFAULT_POLICY = "prefix_affinity"
# The disaggregation router's prefill and decode picks: it counts requests, not tokens.
WORKER_POLICY = "least_busy"


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def policy_help() -> str:
    """The routing-policy option's help text, the same for every command that has one."""
    listed = "; ".join(f"{name}: {_POLICIES[name].summary}" for name in policy_names())
    return f"the routing policy, default {DEFAULT_POLICY} (docs/router.md). {listed}"


def make_policy(name: str) -> RoutingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"routing policy {name!r} is unknown; choose from "
                         f"{policy_names()}") from None


__all__ = ["DEFAULT_POLICY", "WORKER_POLICY", "LeastBusy", "LeastLoaded", "LeastLoadedIndex",
           "PrefixAffinity", "ReplicaLoad", "RoundRobin", "RouteRequest", "RoutingPolicy",
           "Session", "make_policy", "policy_help", "policy_names"]
