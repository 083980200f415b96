"""HostTier: KV blocks in this process's memory, below the device pool.

Owns: an LRU of BlockEntry by chain hash within a byte budget (--kv-host-memory-gb), and
which entries it pushes out to make room (KVTiers hands them to the disk tier): kept
(retained) entries only once no other is left, oldest kept first. Never: decides what is
kept or for how long (KVTiers does, per tenant), touches a file or the device pool; on a
GPU server the runner copies between this memory and the device (the bytes it keeps are
what the runner's KVCache.read_block returned).
"""

from __future__ import annotations

from collections import OrderedDict

from servelm.kv_tiers.bandwidth import BandwidthMeter, MeteredTier
from servelm.kv_tiers.connector import TierStats
from servelm.kv_tiers.entry import BlockEntry, checksum


class HostTier(MeteredTier):
    name = "host"

    def __init__(self, capacity_bytes: int, probe_nbytes: int = 0):
        if capacity_bytes < 0:
            raise ValueError(f"kv_host_memory must be >= 0 bytes, got {capacity_bytes}")
        self._entries: OrderedDict[int, BlockEntry] = OrderedDict()  # oldest first
        self._kept: OrderedDict[int, BlockEntry] = OrderedDict()  # retained, oldest first
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._meter = BandwidthMeter()
        if probe_nbytes > 0:
            buf = bytes(probe_nbytes)
            # A reload from host memory is a checked copy: the checksum and the copy into
            # the pool, which reads the bytes once more.
            self._meter.probe(lambda: _checked_copy(buf))

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._entries or block_hash in self._kept

    def peek(self, block_hash: int) -> BlockEntry | None:
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)  # a hit is a use
            return entry
        return self._kept.get(block_hash)

    read = peek  # in memory: reading never blocks

    def put(self, entry: BlockEntry) -> list[BlockEntry]:
        st = self.stats
        if self.contains(entry.hash):
            self.peek(entry.hash)
            return []
        if entry.num_bytes > st.capacity_bytes:
            return [entry]  # larger than the whole tier: straight through to the next one
        evicted = []
        while st.used_bytes + entry.num_bytes > st.capacity_bytes:
            _, old = (self._entries or self._kept).popitem(last=False)
            st.used_bytes -= old.num_bytes
            st.num_evicted += 1
            evicted.append(old)
        self._entries[entry.hash] = entry
        st.used_bytes += entry.num_bytes
        st.num_stored += 1
        st.num_stored_bytes += entry.num_bytes
        st.num_blocks = len(self._entries) + len(self._kept)
        return evicted

    def keep(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self._kept[block_hash] = entry

    def unkeep(self, block_hash: int) -> None:
        """Back among the others, as the least recently used (it was kept, not used)."""
        entry = self._kept.pop(block_hash, None)
        if entry is not None:
            self._entries[block_hash] = entry
            self._entries.move_to_end(block_hash, last=False)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def discard(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash, None) or self._kept.pop(block_hash, None)
        if entry is not None:
            self.stats.used_bytes -= entry.num_bytes
            self.stats.num_blocks = len(self._entries) + len(self._kept)

    def check_invariants(self) -> None:
        entries = [*self._entries.values(), *self._kept.values()]
        assert self.stats.used_bytes == sum(e.num_bytes for e in entries)
        assert self.stats.used_bytes <= self.stats.capacity_bytes
        assert self.stats.num_blocks == len(entries)
        assert not self._entries.keys() & self._kept.keys()


def _checked_copy(buf: bytes) -> int:
    checksum(buf)
    return len(bytearray(buf))
