"""TierStore: what a store of KV blocks below the device pool implements.

Owns: the interface between KVTiers (servelm/kv_tiers/tiers.py: the engine's KVConnector
that moves blocks down on eviction and decides reloads) and one store, and TierStats, the
counters every store keeps. Never: an implementation (host_tier.py, disk_tier.py hold two).

A store is a pool of BlockEntry keyed by chain hash. The engine thread calls everything but
`read`; `read` may block (a file, a network fetch) and is called on KVTiers' IO thread:

    contains(h)        is h here? (no IO; the engine decides reload vs recompute from it)
    peek(h)            the entry when it is in this process's memory, else None (no IO)
    read(h)            the entry, or None when missing or unreadable (may block)
    put(entry)         keep it; returns the entries it evicted to make room, for the
                       store below (host memory -> disk; the last store drops them)
    discard(h)         forget h (a read found it corrupt)
    keep(h), unkeep(h) h is retained (prompt_cache_retention): evict it after every entry
                       that is not, until unkeep puts it back among them (a store may
                       ignore both: the disk tier is one LRU)
    bandwidth_Bps      measured read bandwidth, for the reload-vs-recompute decision

A later remote store (another replica's host memory over the disaggregation transport, an
LMCache-style server) is one more TierStore at the bottom of the chain: contains() from a
local index of what it announced, read() over the wire, put() as a write-behind send.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from servelm.kv_tiers.entry import BlockEntry


@dataclass
class TierStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0  # occupancy
    num_hits: int = 0  # blocks reloaded from this tier into the device pool
    num_hit_bytes: int = 0  # bytes moved up
    num_stored: int = 0  # blocks moved down into this tier
    num_stored_bytes: int = 0  # bytes moved down
    num_evicted: int = 0  # blocks this tier dropped or moved further down
    num_failed: int = 0  # reads that were missing or failed a check (fell back to recompute)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class TierStore(Protocol):
    name: str
    stats: TierStats

    @property
    def bandwidth_Bps(self) -> float: ...

    def contains(self, block_hash: int) -> bool: ...

    def peek(self, block_hash: int) -> BlockEntry | None: ...

    def read(self, block_hash: int) -> BlockEntry | None: ...

    def put(self, entry: BlockEntry) -> list[BlockEntry]: ...

    def discard(self, block_hash: int) -> None: ...

    def keep(self, block_hash: int) -> None: ...

    def unkeep(self, block_hash: int) -> None: ...

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        """A read of num_bytes took `seconds` (updates bandwidth_Bps)."""
        ...
