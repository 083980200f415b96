"""RetentionBook: which cached KV blocks each tenant asked to keep, until when, and the
per-tenant cap (OpenAI's `prompt_cache_retention`).

Owns: the retained keys (block ids in the device pool's prefix cache, chain hashes in the KV
tiers below it), each with its one tenant and the clock time its retention ends, in the order
they were retained; the cap of `max_per_tenant` keys a tenant may hold, enforced by
un-pinning that tenant's least recently retained keys (never another tenant's, and never
refusing the request: a cache hint is best effort, as OpenAI's is); expiry.
Never: evicts or frees anything (the prefix cache and the tiers do, asking `until` first), or
reads a clock of its own (callers pass `now`: a test's clock or the engine's).

    tenant "project:a"   [b7 b2 | b9 b4 b3]     oldest retention first; a prompt's blocks
    tenant "anonymous"   [b5]                   deepest first, so un-pinning for the cap
                                                 takes a prompt's tail before its head
"""

from __future__ import annotations

from typing import Hashable, NamedTuple


class Retention(NamedTuple):
    """A retained key's owner and the clock time its retention ends."""

    tenant: str
    until: float


class RetentionBook:
    def __init__(self, max_per_tenant: int):
        if max_per_tenant < 0:
            raise ValueError(f"max_per_tenant must be >= 0, got {max_per_tenant}")
        self.max_per_tenant = max_per_tenant
        self._by_tenant: dict[str, dict[Hashable, float]] = {}  # insertion order: oldest first
        self._owner: dict[Hashable, str] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._owner

    def num_held(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def get(self, key: Hashable) -> Retention | None:
        tenant = self._owner.get(key)
        return None if tenant is None else Retention(tenant, self._by_tenant[tenant][key])

    def until(self, key: Hashable) -> float:
        """When key's retention ends (0.0: not retained)."""
        tenant = self._owner.get(key)
        return 0.0 if tenant is None else self._by_tenant[tenant][key]

    def retain(self, tenant: str, keys: list[Hashable], until: float,
               now: float) -> tuple[list[Hashable], list[Hashable]]:
        """Retain `keys` (a prompt's, root first) for `tenant` until `until`: at most the
        cap's first keys. Returns (retained, un-pinned): the keys now held, and the keys
        (of this tenant, expired ones first, then the least recently retained) that lost
        their retention to make room. A key another tenant held moves to this one."""
        if self.max_per_tenant <= 0 or not keys:
            return [], []
        keys = list(dict.fromkeys(keys))[:self.max_per_tenant]
        for key in keys:  # re-retained keys move to the newest end (and keep a later end)
            until = max(until, self._pop(key, tenant))
        held = self._by_tenant.setdefault(tenant, {})
        unpinned = self._make_room(tenant, len(held) + len(keys) - self.max_per_tenant, now)
        for key in reversed(keys):  # deepest first: the cap takes a prompt's tail first
            held[key] = until
            self._owner[key] = tenant
        return keys, unpinned

    def _pop(self, key: Hashable, tenant: str) -> float:
        """Forget key (held by anyone) before it is retained again; its end if `tenant`
        held it (a retention never ends earlier for being asked again)."""
        owner = self._owner.pop(key, None)
        if owner is None:
            return 0.0
        until = self._by_tenant[owner].pop(key)
        if not self._by_tenant[owner]:
            del self._by_tenant[owner]
        return until if owner == tenant else 0.0

    def _make_room(self, tenant: str, num: int, now: float) -> list[Hashable]:
        held = self._by_tenant[tenant]
        if num <= 0:
            return []
        expired = [k for k, t in held.items() if t <= now][:num]
        skip = set(expired)
        out = expired + [k for k in held if k not in skip][:num - len(expired)]
        for key in out:
            del held[key]
            del self._owner[key]
        return out

    def release(self, key: Hashable) -> Retention | None:
        """key left the cache (evicted, discarded): forget it. Its retention, if it had one."""
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return None
        held = self._by_tenant[tenant]
        until = held.pop(key)
        if not held:
            del self._by_tenant[tenant]
        return Retention(tenant, until)

    def expire(self, now: float) -> list[Hashable]:
        """Forget and return the keys whose retention has ended, read from each tenant's
        oldest end: retention order is expiry order while every retention asks the same
        duration (OpenAI's one value, 24h); a shorter one behind a longer one waits for it."""
        out = []
        for held in self._by_tenant.values():
            for key, until in held.items():
                if until > now:
                    break
                out.append(key)
        for key in out:
            self.release(key)
        return out

    def check_invariants(self) -> None:
        assert sum(len(h) for h in self._by_tenant.values()) == len(self._owner)
        for tenant, held in self._by_tenant.items():
            assert held, f"tenant {tenant!r} kept without a key"
            assert len(held) <= self.max_per_tenant, f"tenant {tenant!r} over its cap"
            assert all(self._owner[k] == tenant for k in held)


__all__ = ["Retention", "RetentionBook"]
