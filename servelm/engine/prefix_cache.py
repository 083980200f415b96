"""PrefixCache: a radix tree over token ids at block granularity.

Owns: which KV blocks hold which token prefixes, per namespace (`extra_key`: cache salt,
adapter id), and least-recently-used eviction of blocks no sequence references, except that
retained blocks (a prompt asking `prompt_cache_retention`, `retain`) go last, earliest
expiry first, until their retention ends; at most `max_retained_blocks` per tenant (the
RetentionBook un-pins a tenant's least recently retained blocks past it).
Never: tensors, or reference counting of blocks (the BlockManager counts holders and tells
the cache when a cached block becomes free to evict or is taken again), or memory that
outgrows the KV pool: a namespace lives only while it holds a block (its root goes with its
last block), and the lazy LRU heap is compacted when stale entries outnumber live ones, so
the bookkeeping is O(cached blocks) whatever the clients send (`usage()` measures it).

Each edge is one full block of tokens; a node is the block holding them:

    root[salt=None]
      ├─ (t0..t15) blk 7 ── (t16..t31) blk 2 ── (t32..t47) blk 9     "system prompt + turn 1"
      │                   └ (u16..u31) blk 4                          "system prompt + turn 1'"
      └─ (v0..v15) blk 3

A sequence holding a node's block also holds every ancestor's, so an unreferenced node has
only unreferenced descendants: eviction takes unreferenced leaves, oldest access first.
A retained leaf met there moves to a second heap ordered by expiry, taken only when the first
is empty or its head has expired: retention is a priority, never a pin, so a pool full of
retained blocks still serves every request. A retained block evicted all the same is handed
to `on_evict` with its retention, so the KV tiers below the pool keep it there instead.

KV events (for a router's view of what this replica caches): once `record_events` is on,
every block that enters the tree and every block that leaves it is logged as
(STORED | REMOVED, chain hash, parent's chain hash). A chain hash names a block by its
content and everything before it, in its namespace (`block_hashes`), so another process can
compute the hashes of a prompt and look them up without the block ids.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from servelm.engine.retention_book import RetentionBook

DEFAULT_TENANT = "anonymous"  # whose retention a request without a tenant asks


class PrefixMatch(NamedTuple):
    blocks: list[int]
    num_tokens: int


class PrefixCacheUsage(NamedTuple):
    """What the cache's bookkeeping holds (exported on /metrics)."""

    num_namespaces: int
    num_cached_blocks: int
    num_lru_entries: int
    num_bytes: int  # estimate: nodes, their token keys, namespace keys, LRU entries


STORED, REMOVED = 0, 1  # KV event kinds


def namespace_hash(extra_key) -> int:
    """The chain hash of a namespace's root (no cache salt: 0)."""
    if extra_key is None:
        return 0
    digest = hashlib.blake2b(str(extra_key).encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def block_hash(parent_hash: int, key: tuple[int, ...]) -> int:
    """A block's chain hash: its tokens and its parent's chain hash (63 bits, stable across
    processes and machines)."""
    data = struct.pack(f"<q{len(key)}q", parent_hash, *key)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def block_hashes(token_ids: list[int], block_size: int, extra_key=None) -> list[int]:
    """Chain hashes of the full blocks of `token_ids` (what a router looks up)."""
    out, h = [], namespace_hash(extra_key)
    for i in range(len(token_ids) // block_size):
        h = block_hash(h, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(h)
    return out


class _Node:
    """One cached block (a root: a namespace, block -1). A plain class with slots: a
    2,000-token prompt makes 125 of them, so their construction is on the hot path."""

    __slots__ = ("block", "key", "parent", "children", "last_access", "is_evictable",
                 "namespace", "hash", "retained_until")

    def __init__(self, block: int, key: tuple[int, ...], parent: "_Node | None",
                 last_access: int = 0, namespace: object = None):
        self.block = block
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = last_access
        self.is_evictable = False  # no sequence holds the block
        self.namespace = namespace  # roots only: the extra_key they are filed under
        self.hash = 0  # chain hash (set while events or hashes are kept; roots: the namespace's)
        self.retained_until = 0.0  # clock time its retention ends (0: none)


# Rough CPython sizes (64-bit) behind PrefixCacheUsage.num_bytes: a node (object, its dict of
# children, its entries in the parent's dict and in the block index), a tuple's header and
# one int pointer per token, an LRU heap entry (a 3-tuple and its list slot).
_NODE_BYTES = 400
_TUPLE_BYTES, _TOKEN_BYTES = 56, 8
_LRU_ENTRY_BYTES = 72
_MIN_LRU_COMPACT = 64  # below this many entries a rebuild is not worth it


@dataclass
class PrefixCacheStats:
    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache:
    def __init__(self, block_size: int, max_retained_blocks: int = 0, clock=time.monotonic):
        """max_retained_blocks: per tenant (0: retention off). clock: what retention ends
        are measured in (the KV tiers read the same one)."""
        self.block_size = block_size
        self.max_retained_blocks = max_retained_blocks
        self.clock = self._now = clock
        self._retention = RetentionBook(max_retained_blocks)  # block id -> tenant, end
        self._retained_lru: list[tuple[float, int, _Node]] = []  # (retained_until, ...)
        self._roots: dict[object, _Node] = {}
        self._nodes: dict[int, _Node] = {}  # block id -> node
        self._clock = itertools.count(1)
        self._lru: list[tuple[int, int, _Node]] = []  # (last_access, tiebreak, node), lazy
        self._tiebreak = itertools.count()
        self.num_evictable_blocks = 0
        self._num_namespace_bytes = 0  # sizes of the extra_keys of live namespaces
        self.stats = PrefixCacheStats()
        self.record_events = False
        self._events: list[tuple[int, int, int]] = []  # (kind, hash, parent hash)
        # KV tiers (servelm/kv_tiers/): chain hashes kept on every node (enable_hashes), and
        # on_evict(block, hash, parent hash, token ids, retention) called for each block
        # evict() drops, so its content can be saved below the pool before the block is
        # reused (retention: a Retention still running, else None).
        self.keep_hashes = False
        self.on_evict = None

    def enable_events(self) -> None:
        """Log blocks stored and removed from now on (drain_events); blocks already cached
        are logged as stored first, so a listener's view starts complete."""
        if self.record_events:
            return
        self.record_events = True
        self._hash_tree(log=True)

    def enable_hashes(self) -> None:
        """Keep every node's chain hash from now on, without logging events."""
        if not (self.keep_hashes or self.record_events):
            self._hash_tree(log=False)
        self.keep_hashes = True

    def _hash_tree(self, log: bool) -> None:
        """Chain hashes on the blocks cached so far; log: each as STORED."""
        stack = list(self._roots.values())
        for root in stack:
            root.hash = namespace_hash(root.namespace)
        while stack:
            node = stack.pop()
            for child in node.children.values():
                child.hash = block_hash(node.hash, child.key)
                if log:
                    self._events.append((STORED, child.hash, node.hash))
                stack.append(child)

    def drain_events(self) -> list[tuple[int, int, int]]:
        events, self._events = self._events, []
        return events

    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    def contains(self, block: int) -> bool:
        return block in self._nodes

    @property
    def blocks(self):
        """The cached blocks, a live read-only view (`block in cache.blocks` is contains)."""
        return self._nodes.keys()

    @property
    def num_namespaces(self) -> int:
        return len(self._roots)

    def usage(self) -> PrefixCacheUsage:
        nodes = len(self._nodes) + len(self._roots)
        key_bytes = len(self._nodes) * (_TUPLE_BYTES + _TOKEN_BYTES * self.block_size)
        num_bytes = (nodes * _NODE_BYTES + key_bytes + self._num_namespace_bytes
                     + len(self._lru) * _LRU_ENTRY_BYTES)
        return PrefixCacheUsage(len(self._roots), len(self._nodes), len(self._lru), num_bytes)

    def _add_root(self, extra_key) -> _Node:
        """A namespace is filed only once it gets its first block (see _remove)."""
        root = self._roots[extra_key] = _Node(-1, (), None, namespace=extra_key)
        if self.record_events or self.keep_hashes:
            root.hash = namespace_hash(extra_key)
        self._num_namespace_bytes += _key_bytes(extra_key)
        return root

    def _block_keys(self, tokens: list[int], num_blocks: int):
        bs = self.block_size
        return (tuple(tokens[i * bs:(i + 1) * bs]) for i in range(num_blocks))

    def match(self, tokens: list[int], extra_key=None, max_tokens: int | None = None,
              record: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole blocks, at most `max_tokens` long.
        record=False: a look only (no hit statistics, no LRU touch)."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node, blocks = self._roots.get(extra_key), []
        now = next(self._clock)
        if node is not None:
            for key in self._block_keys(tokens, limit // self.block_size):
                node = node.children.get(key)
                if node is None:
                    break
                if record:
                    node.last_access = now
                blocks.append(node.block)
        if record:
            self.stats.num_queries += 1
            self.stats.num_query_tokens += len(tokens)
            self.stats.num_hit_tokens += len(blocks) * self.block_size
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def insert(self, tokens: list[int], blocks: list[int], extra_key=None,
               start: int = 0, parent_block: int | None = None) -> int:
        """Add the full blocks blocks[start:] holding tokens[start*bs:]. Stops at the first
        block whose tokens are already cached under another block (that copy stays private
        to its sequence). Returns how many blocks are now cached along this path."""
        if start == 0:
            parent = self._roots.get(extra_key)
            if parent is None:
                if not blocks:
                    return 0
                parent = self._add_root(extra_key)
        else:
            parent = self._nodes.get(parent_block)
        if parent is None:
            return start
        now = next(self._clock)
        bs = self.block_size
        nodes = self._nodes
        hashed = self.record_events or self.keep_hashes
        for i in range(start, len(blocks)):  # keys of the new blocks only (a decode step
            key = tuple(tokens[i * bs:(i + 1) * bs])  # inserts one block of a long prompt)
            block = blocks[i]
            new = _Node(block, key, parent, now)
            node = parent.children.setdefault(key, new)  # one hash of the key, not two
            if node is new:
                nodes[block] = node
                if hashed:
                    node.hash = block_hash(parent.hash, key)
                    if self.record_events:
                        self._events.append((STORED, node.hash, parent.hash))
            elif node.block != block:
                return i
            parent = node
        return len(blocks)

    def set_evictable(self, block: int, evictable: bool) -> None:
        """The BlockManager's word: no sequence holds `block` now (or one holds it again)."""
        node = self._nodes[block]
        if node.is_evictable == evictable:
            return
        node.is_evictable = evictable
        self.num_evictable_blocks += 1 if evictable else -1
        if evictable and not node.children:
            self._push(node)

    def release(self, blocks) -> None:
        """set_evictable(block, True) for each of `blocks` (cached ones, in that order): what
        the BlockManager says of a finished sequence's cached blocks, in one call."""
        nodes = self._nodes
        for block in blocks:
            node = nodes[block]
            if node.is_evictable:
                continue
            node.is_evictable = True
            self.num_evictable_blocks += 1
            if not node.children:
                self._push(node)

    def _push(self, node: _Node) -> None:
        # Entries are lazy (a block taken again, or touched, leaves its old entry behind):
        # without compaction a hot prefix released after every request would grow the heap
        # by one entry per request, forever, while nothing is evicted.
        if len(self._lru) >= max(_MIN_LRU_COMPACT, 2 * self.num_evictable_blocks):
            self._compact_lru()
        heapq.heappush(self._lru, (node.last_access, next(self._tiebreak), node))

    def _compact_lru(self) -> None:
        """One entry per evictable leaf, at its current age (retained ones too: the first
        heap sorts them out again)."""
        self._retained_lru = []
        self._lru = [(n.last_access, next(self._tiebreak), n) for n in self._nodes.values()
                     if n.is_evictable and not n.children]
        heapq.heapify(self._lru)

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks unreferenced blocks, least recently used leaves first
        (retained ones after every other, earliest expiry first)."""
        freed = []
        now = self._now()
        lru, retained = self._lru, self._retained_lru
        while len(freed) < num_blocks and (lru or retained):
            from_retained = bool(retained) and (not lru or retained[0][0] <= now)
            key, _, node = heapq.heappop(retained if from_retained else lru)
            if (self._nodes.get(node.block) is not node or not node.is_evictable
                    or node.children):
                continue  # stale entry
            if node.retained_until > now and (not from_retained or key != node.retained_until):
                # retained since queued, or its retention extended: requeue at its end
                heapq.heappush(retained, (node.retained_until, next(self._tiebreak), node))
                continue
            if from_retained and key != node.retained_until:
                self._push(node)  # un-pinned for its tenant's cap: back in the LRU order
                continue
            if not from_retained and key != node.last_access:
                self._push(node)  # touched since queued: requeue at its real age
                continue
            retention = self._retention.get(node.block) if node.retained_until > now else None
            self._remove(node)
            freed.append(node.block)
            if self.on_evict is not None:
                self.on_evict(node.block, node.hash, node.parent.hash, node.key, retention)
        self.stats.num_evicted_blocks += len(freed)
        return freed

    def retain(self, blocks: list[int], duration_s: float, tenant: str = DEFAULT_TENANT) -> int:
        """Keep the cached `blocks` (a prompt's, root first) ahead of others in the eviction
        order for `duration_s`, within the tenant's cap: past it, the tenant's least recently
        retained blocks go back to plain LRU. Returns how many of `blocks` are retained."""
        if self.max_retained_blocks <= 0 or duration_s <= 0:
            return 0
        now = self._now()
        cached = []
        for block in blocks:
            if block not in self._nodes:
                break
            cached.append(block)
        kept, unpinned = self._retention.retain(tenant, cached, now + duration_s, now)
        for block in unpinned:
            self._nodes[block].retained_until = 0.0
        for block in kept:
            self._nodes[block].retained_until = self._retention.until(block)
        return len(kept)

    @property
    def num_retained_blocks(self) -> int:
        return len(self._retention)

    def num_retained_by(self, tenant: str) -> int:
        return self._retention.num_held(tenant)

    def _forget_retention(self, node: _Node) -> None:
        if node.retained_until:
            node.retained_until = 0.0
            self._retention.release(node.block)

    def _remove(self, node: _Node) -> None:
        self._forget_retention(node)
        if self.record_events:
            self._events.append((REMOVED, node.hash, node.parent.hash))
        del self._nodes[node.block]
        self.num_evictable_blocks -= 1
        parent = node.parent
        del parent.children[node.key]
        if parent.parent is None:
            if not parent.children:  # an empty namespace costs nothing
                del self._roots[parent.namespace]
                self._num_namespace_bytes -= _key_bytes(parent.namespace)
        elif parent.is_evictable and not parent.children:
            self._push(parent)

    def check_invariants(self) -> None:
        seen = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                assert child.parent is node and self._nodes[child.block] is child
                if not child.is_evictable:
                    assert not node.is_evictable or node.parent is None, \
                        "a held block under an unheld parent"
                seen += 1
                stack.append(child)
        assert seen == len(self._nodes), "tree and block index disagree"
        assert self.num_evictable_blocks == sum(n.is_evictable for n in self._nodes.values())
        for key, root in self._roots.items():
            assert root.children, f"namespace {key!r} kept without a block"
            assert root.namespace == key
        assert self._num_namespace_bytes == sum(_key_bytes(k) for k in self._roots)
        self._retention.check_invariants()
        assert len(self._retention) == sum(bool(n.retained_until) for n in self._nodes.values())
        for node in self._nodes.values():
            assert node.retained_until == self._retention.until(node.block), \
                f"block {node.block}: retention and book disagree"


def _key_bytes(extra_key) -> int:
    return len(extra_key.encode("utf-8", "surrogatepass")) if isinstance(extra_key, str) else 0
