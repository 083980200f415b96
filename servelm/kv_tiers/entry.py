"""BlockEntry: one KV block as a tier below the device pool keeps it, and its checks.

Owns: what a stored block carries besides its bytes (its chain hash, its parent's, the token
ids it holds, a checksum of the bytes) and `verify`, the test every block passes before its
bytes go back into the device pool. Never: decides where a block lives or moves.

A block's chain hash (servelm/engine/prefix_cache.py block_hash) names its tokens, every
token before it and the cache salt's namespace, so one hash never names two contents in two
tenants; the checks below make a lookup by hash safe against a file that was truncated,
overwritten, or written by a hash collision:

    hash == expected          the block the request asked for
    parent == expected        ... directly after the block it already has
    tokens == request's       ... holding the tokens the request holds there
    block_hash(parent, tokens) == hash
    blake2b(data) == checksum the bytes are the ones that were saved
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from servelm.engine.prefix_cache import block_hash


class BlockEntry(NamedTuple):
    hash: int  # chain hash (prefix_cache.block_hash)
    parent_hash: int  # the previous block's chain hash, or the namespace's
    token_ids: tuple[int, ...]
    data: bytes  # KVCache.read_block layout
    checksum: bytes  # checksum(data)

    @property
    def num_bytes(self) -> int:
        return len(self.data)


CHECKSUM_BYTES = 16


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def make_entry(block_hash_: int, parent_hash: int, token_ids, data: bytes) -> BlockEntry:
    return BlockEntry(block_hash_, parent_hash, tuple(token_ids), bytes(data), checksum(data))


def verify(entry: BlockEntry, expected_hash: int, expected_parent: int,
           token_ids) -> str | None:
    """None when the entry may be used in place of the block; else what failed."""
    if entry.hash != expected_hash:
        return "hash"
    if entry.parent_hash != expected_parent:
        return "parent"
    if entry.token_ids != tuple(token_ids):
        return "tokens"
    if block_hash(entry.parent_hash, entry.token_ids) != entry.hash:
        return "chain"
    if checksum(entry.data) != entry.checksum:
        return "checksum"
    return None
