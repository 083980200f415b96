"""EncoderCache: image embeddings by content hash, least recently used first out, sized in
image tokens. The same image in a later turn or another request is not encoded again.

Owns: the entries and their hit/miss counts. Never: decides what to encode (the runner hook
does), or evicts an entry a sequence still needs (the hook also holds each sequence's own
embeddings until its prefill has passed them, so eviction here only costs a re-encode).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.num_tokens = 0
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str):
        entry = self._entries.get(key)
        if entry is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def put(self, key: str, value, num_tokens: int) -> None:
        if key in self._entries or num_tokens > self.capacity_tokens:
            return
        self._entries[key] = (value, num_tokens)
        self.num_tokens += num_tokens
        while self.num_tokens > self.capacity_tokens:
            _, (_, n) = self._entries.popitem(last=False)
            self.num_tokens -= n


__all__ = ["EncoderCache"]
