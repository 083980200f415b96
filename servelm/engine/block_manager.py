"""BlockManager: the paged KV pool as plain integers.

Owns: which KV blocks are free, how many sequences hold each block (ref counts), each
sequence's block table, and (when enabled) the prefix cache's view of which full blocks can
be shared. Never: tensors; the runner owns the KV memory the block ids index.

A sequence's block table maps its token positions to slots:

    position p  ->  block_table[p // block_size] * block_size + p % block_size

    tokens:  [t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...]     block_size = 16
    table:   [   7      |    2       |    9          ]      (block 9 partly filled)

Every block is in exactly one state:
    free           on the free list, ref count 0
    held           ref count >= 1 (by sequences; full ones may also be in the prefix cache)
    cached-only    in the prefix cache, ref count 0: reusable on a hit, evicted when needed
so free + held + cached-only == total, and cached-only blocks count as free capacity.
Only full blocks enter the cache, and a sequence only ever writes past its cached prefix, so
a shared block is never written: no copy-on-write is needed.

The free list is a stack: a freed block is the next one handed out, and a block no sequence
has held yet is taken only when every freed one is in use. So the ids in use never spread
past the most blocks ever held at once, however requests come and go. A first-in-first-out
list walks the whole pool and, once requests finish in another order than they started,
scatters each sequence over all of it: the KV reads then cross many more pages (the default
model's CPU decode: 4% slower on such a list aged by served traffic than on a fresh pool, 7%
on a pool scrambled block by block, 2% on this stack aged alike; docs/sim.md, "The measuring
server's steps"). Which ids are taken changes nothing else: the scheduler counts blocks.
(A heap, lowest id first, packs as well but cost the fleet simulator 11-16% of its speed;
the stack costs what the queue did.)

Sliding window (every layer attends only its last W keys, `sliding_window` W): a block
wholly below the window of a sequence's next query is never read again, so it goes back to
the pool and its table entry becomes DROPPED (the positions stay where they were):

    W = 8, block_size 4, next query at position 17 reads keys 10..17
    table: [ 7 | 2 | 9 | 4 | 5 ]  ->  [ DROPPED | 2 | 9 | 4 | 5 ]     block 7 freed

The runner is not told: its table keeps the old id, and its sliding-window attention masks
those positions, so what lies in a reused block is never weighed. Blocks in the prefix cache
are shared and stay; with the window on, only a prompt's blocks enter the cache, so the
blocks a sequence generates are its own and are dropped as the window passes them.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Callable

from servelm.engine.prefix_cache import DEFAULT_TENANT, PrefixCache, PrefixMatch
from servelm.engine.sequence import Sequence

_NO_MATCH = PrefixMatch([], 0)


@functools.lru_cache(maxsize=4)
def _block_ids(num_blocks: int) -> tuple[int, ...]:
    """0 .. num_blocks - 1, made once per pool size: a simulated fleet builds hundreds of
    equal pools, and a deque copies a tuple's ints faster than it makes them."""
    return tuple(range(num_blocks))


DROPPED = -1  # a block table entry whose block left the sliding window (module doc)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int = 0, max_retained_blocks: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        """sliding_window: every layer's window (ModelConfig.uniform_sliding_window), 0 for
        none. A window under two blocks frees nothing worth its bookkeeping: treated as 0.
        max_retained_blocks: the prefix cache's cap on retained blocks per tenant; clock:
        what their retention is measured in."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.sliding_window = sliding_window if sliding_window >= 2 * block_size else 0
        self._drop_cursor: dict[int, int] = {}  # seq_id -> table index dropping has reached
        self.num_blocks = num_blocks
        self.block_size = block_size
        # taken from the left; freed blocks go back on the left (a stack: module doc)
        self._free: deque[int] = deque(_block_ids(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.prefix_cache = (PrefixCache(block_size, max_retained_blocks, clock)
                             if enable_prefix_caching else None)
        # seq_id -> blocks of that sequence already in the prefix cache
        self._num_cached: dict[int, int] = {}
        # block -> references held outside any sequence: KV transfers in flight pin the
        # blocks they read or fill (servelm/disagg/), so neither eviction nor reuse can
        # touch them until the transfer ends
        self._pins: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus unreferenced cached ones."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix matching -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached full blocks at the start of seq. At least one token is always left to
        compute, so that the step yields a next-token distribution."""
        if self.prefix_cache is None or seq.block_table or seq.params.needs_prompt_states:
            return _NO_MATCH
        return self.prefix_cache.match(seq.cache_token_ids, seq.extra_key, seq.num_tokens - 1)

    # -- allocation ------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          match: PrefixMatch = _NO_MATCH) -> int:
        """Blocks to add so seq holds KV for `num_new_tokens` more tokens (past a match)."""
        computed = seq.num_computed_tokens + match.num_tokens
        total = self.blocks_for_tokens(computed + num_new_tokens)
        return max(0, total - len(seq.block_table) - len(match.blocks))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0,
                     match: PrefixMatch = _NO_MATCH) -> bool:
        # A hit on an unreferenced cached block takes it out of the evictable pool.
        revived = sum(1 for b in match.blocks if self._ref_counts[b] == 0)
        needed = self.num_blocks_needed(seq, num_new_tokens, match)
        return needed + reserve + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 match: PrefixMatch = _NO_MATCH) -> None:
        """Take the matched blocks (if any), then fresh ones for num_new_tokens; register
        the blocks this step fills in the prefix cache (see register_computed)."""
        needed = self.num_blocks_needed(seq, num_new_tokens, match)
        revived = sum(1 for b in match.blocks if self._ref_counts[b] == 0) if match.blocks else 0
        if needed + revived > self.num_free_blocks:  # can_allocate's test
            raise RuntimeError("allocate without can_allocate")
        table = seq.block_table
        if match.blocks:
            for block in match.blocks:
                self._take(block)
            table += match.blocks
            seq.num_computed_tokens += match.num_tokens
            self._num_cached[seq.seq_id] = len(match.blocks)
        if needed:
            self._append_fresh(table, needed)
        # Only real tokens are registered: draft slots (speculation) hold no known token yet.
        self.register_computed(seq, min(seq.num_computed_tokens + num_new_tokens,
                                        seq.num_tokens))

    def allocate_decode(self, seq: Sequence) -> None:
        """allocate(seq, 1) with no prefix match (a decode's one new position), without its
        general bookkeeping: the blocks position num_computed_tokens needs, then the same
        register_computed (the simulator calls it where a decode takes or fills a block)."""
        table = seq.block_table
        c = seq.num_computed_tokens
        needed = -(-(c + 1) // self.block_size) - len(table)
        if needed > 0:
            if needed > self.num_free_blocks:  # can_allocate's test
                raise RuntimeError("allocate without can_allocate")
            self._append_fresh(table, needed)
        if self.prefix_cache is not None:
            self.register_computed(seq, min(c + 1, len(seq.token_ids)))

    def _append_fresh(self, table: list[int], needed: int) -> None:
        """`needed` blocks no sequence holds onto `table`. A block on the free list is in no
        cache and held by none: taking it sets its count to 1, without a call per block;
        past the free list, blocks come from eviction (_pop_free)."""
        free, refs = self._free, self._ref_counts
        fresh = min(needed, len(free))
        if fresh == 1:  # a decode's next block
            block = free.popleft()
            refs[block] = 1
            table.append(block)
        elif fresh:  # a prompt chunk's blocks: taken in one comprehension
            popleft = free.popleft
            taken = [popleft() for _ in range(fresh)]
            for block in taken:
                refs[block] = 1
            table += taken
        for _ in range(needed - fresh):
            block = self._pop_free()
            self._take(block)
            table.append(block)

    def register_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Put seq's full blocks below position `num_tokens` into the prefix cache.

        Called at scheduling time for the tokens this step will compute: a sequence matched
        later in the same step reads them in the same forward pass, after every layer has
        written its K/V and before it attends."""
        cache = self.prefix_cache
        if cache is None:
            return
        if self.sliding_window:  # generated blocks stay private, to be dropped (module doc)
            num_tokens = min(num_tokens, seq.num_prompt_tokens)
        done = self._num_cached.get(seq.seq_id, 0)
        full = min(num_tokens // self.block_size, len(seq.block_table))
        if full <= done or done < 0:
            return
        parent = seq.block_table[done - 1] if done else None
        cached = cache.insert(seq.cache_token_ids, seq.block_table[:full], seq.extra_key, done,
                              parent)
        # A block found cached under another id stops the path: its copy stays private.
        self._num_cached[seq.seq_id] = cached if cached == full else -1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's blocks past those holding positions < num_tokens (speculative
        rollback). The released blocks were never registered in the prefix cache."""
        keep = self.blocks_for_tokens(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        done = self._num_cached.get(seq.seq_id, 0)
        assert done <= keep, "trimmed a block registered in the prefix cache"

    def _pop_free(self) -> int:
        if not self._free:
            self._free.extend(self.prefix_cache.evict(1))
        return self._free.popleft()

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0 and self.prefix_cache and self.prefix_cache.contains(block):
            self.prefix_cache.set_evictable(block, False)
        self._ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Release every block of seq, newest first: on the free list the oldest ends on top,
        so the next sequence takes them in table order."""
        # _release, inlined; the blocks that become evictable are told to the cache in one
        # call, in the same order (between them the cache sees no other change)
        refs, cache, free = self._ref_counts, self.prefix_cache, self._free
        cached = cache.blocks if cache is not None else ()
        if cache is not None and seq.params.cache_retention_s:  # its cached prompt blocks
            cache.retain(seq.block_table[:seq.num_prompt_tokens // self.block_size],
                         seq.params.cache_retention_s,
                         seq.params.prompt_cache_tenant or DEFAULT_TENANT)
        evictable: list[int] = []
        try:
            for block in reversed(seq.block_table):
                if block == DROPPED:
                    continue
                count = refs[block]
                if count <= 0:
                    raise RuntimeError(f"double free of block {block}")
                refs[block] = count - 1
                if count == 1:
                    if block in cached:
                        evictable.append(block)
                    else:
                        free.appendleft(block)
        finally:
            if evictable:
                cache.release(evictable)
        seq.block_table = []
        self._num_cached.pop(seq.seq_id, None)
        self._drop_cursor.pop(seq.seq_id, None)

    def drop_out_of_window(self, seq: Sequence) -> int:
        """Free seq's private blocks that hold only positions below the sliding window of
        its next query (position num_computed_tokens); returns how many. Cached and pinned
        blocks stay. No-op without a window."""
        window = self.sliding_window
        if not window:
            return 0
        # block j holds positions jB .. jB+B-1; the next query q reads q-W+1 .. q, so j is
        # dead once (j+1)B <= q-W+1 (kept one position wider: (j+1)B <= q-W)
        limit = min((seq.num_computed_tokens - window) // self.block_size,
                    len(seq.block_table))
        table, cache = seq.block_table, self.prefix_cache
        dropped = 0
        for j in range(self._drop_cursor.get(seq.seq_id, 0), limit):
            block = table[j]
            if (block == DROPPED or block in self._pins
                    or (cache is not None and cache.contains(block))):
                continue
            self._release(block)
            table[j] = DROPPED
            dropped += 1
        if limit > 0:
            self._drop_cursor[seq.seq_id] = max(limit, self._drop_cursor.get(seq.seq_id, 0))
        return dropped

    def _release(self, block: int) -> None:
        count = self._ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"double free of block {block}")
        self._ref_counts[block] = count - 1
        if count == 1:
            if self.prefix_cache is not None and self.prefix_cache.contains(block):
                self.prefix_cache.set_evictable(block, True)
            else:
                self._free.appendleft(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- pins: references held by KV transfers, not by sequences ---------------------------

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins)

    def pin(self, blocks: list[int]) -> None:
        """Hold `blocks` (a sequence's or cached ones) until unpin: they stay allocated
        and out of eviction whatever happens to the sequences that hold them."""
        for block in blocks:
            self._take(block)
            self._pins[block] = self._pins.get(block, 0) + 1

    def unpin(self, blocks: list[int]) -> None:
        for block in blocks:
            count = self._pins.get(block, 0)
            if count <= 0:
                raise RuntimeError(f"unpin of block {block}, which is not pinned")
            if count == 1:
                del self._pins[block]
            else:
                self._pins[block] = count - 1
            self._release(block)

    def reserve(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks, pinned (a KV import writes them before any sequence
        holds them). The caller checks num_free_blocks first."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"reserve of {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = [self._pop_free() for _ in range(num_blocks)]
        self.pin(blocks)
        return blocks

    def cache_imported(self, token_ids: list[int], blocks: list[int], extra_key,
                       start: int) -> int:
        """File blocks[start:] (pinned, filled by a KV import) in the prefix cache as the
        full blocks of token_ids; blocks[:start] must be cached already. Returns how many
        blocks are cached along the path (less than len(blocks): the rest stay private)."""
        if self.prefix_cache is None:
            return 0
        parent = blocks[start - 1] if start else None
        return self.prefix_cache.insert(token_ids, blocks, extra_key, start, parent)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Ref counts equal holders; free + held + cached-only == total."""
        holders = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                if block != DROPPED:
                    holders[block] += 1
        for block, count in self._pins.items():
            holders[block] += count
        assert holders == self._ref_counts, "ref counts disagree with block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cache = self.prefix_cache
        cached_only = 0
        for block in range(self.num_blocks):
            in_cache = cache is not None and cache.contains(block)
            assert not (block in free and (holders[block] or in_cache)), f"block {block} misfiled"
            if holders[block] == 0 and block not in free:
                assert in_cache, f"block {block} leaked"
                cached_only += 1
        held = sum(1 for h in holders if h)
        assert len(free) + held + cached_only == self.num_blocks
        if cache is not None:
            assert cache.num_evictable_blocks == cached_only
            cache.check_invariants()
