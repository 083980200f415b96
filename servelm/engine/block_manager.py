"""BlockManager: the paged KV pool as plain integers.

Owns: which KV blocks are free, how many holders each used block has (ref counts), and each
sequence's block table. Never: tensors; the runner owns the KV memory the block ids index.

A sequence's block table maps its token positions to slots:

    position p  ->  block_table[p // block_size] * block_size + p % block_size

    tokens:  [t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...]     block_size = 16
    table:   [   7      |    2       |    9          ]      (block 9 partly filled)
"""

from __future__ import annotations

from collections import deque

from servelm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that seq can hold KV for `num_new_tokens` more tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate without can_allocate: need {needed}, "
                               f"have {len(self._free)}")
        for _ in range(needed):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"free block {block} has holders"
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of seq (newest first, so older blocks are reused last)."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def _release(self, block: int) -> None:
        count = self._ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"double free of block {block}")
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_invariants(self, live: list[Sequence]) -> None:
        """free + held == total, and each block's ref count equals its holders."""
        holders = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                holders[block] += 1
        assert holders == self._ref_counts, "ref counts disagree with block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert (block in free) == (holders[block] == 0), f"block {block} leaked or shared"
