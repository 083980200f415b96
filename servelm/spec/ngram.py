"""N-gram proposer (prompt lookup decoding): no model, just the sequence's own tokens.

Find the most recent earlier occurrence of the sequence's last n tokens (longest n first,
ngram_max down to ngram_min) and propose the tokens that followed it. Pays on copy-heavy
work: rewriting a paragraph or code with small edits, quoting a document, extracting fields.

An index per sequence maps each n-gram to the position just after its latest occurrence and
is extended with the new tokens each step, so a lookup is O(n), not a scan of the context.
"""

from __future__ import annotations

from servelm.spec.proposer import Proposal, Proposer


class _Index:
    __slots__ = ("maps", "upto")

    def __init__(self, sizes: range):
        self.upto = 0  # n-grams ending before this position are indexed
        self.maps = {n: {} for n in sizes}


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2):
        self.sizes = range(ngram_min, ngram_max + 1)
        self._index: dict[int, _Index] = {}

    def propose(self, scheduled: list) -> dict[int, Proposal]:
        out = {}
        for s in scheduled:
            drafts = self.lookup(s.seq.seq_id, s.seq.token_ids, s.num_spec)
            if drafts:
                out[s.seq.seq_id] = Proposal(drafts)
        return out

    def lookup(self, key: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of tokens' suffix."""
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = _Index(self.sizes)
        length = len(tokens)
        # Index n-grams ending at positions upto .. length - 1 (not the suffix itself).
        for end in range(max(index.upto, 1), length):
            for n, table in index.maps.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        index.upto = max(index.upto, length)
        for n in reversed(self.sizes):
            if n > length:
                continue
            end = index.maps[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
