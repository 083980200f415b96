"""The BlockManager's fast paths leave exactly the state of the general ones: a random mix of
prefills, decodes, prefix hits, finishes and evictions on twin managers, one taking each
decode's blocks with allocate_decode and freeing with free(), the other with allocate(seq, 1)
and one _release per block (what free did block by block), must agree after every
operation on ref counts, the free list's order, the table of every sequence, and the prefix
cache (cached blocks, evictable count, LRU stamps and heap)."""

from __future__ import annotations

import random

import pytest

from servelm.engine.block_manager import BlockManager
from servelm.engine.sequence import Sequence
from servelm.protocol import RequestTimings, SamplingParams


def _state(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    cache = bm.prefix_cache
    return (list(bm._ref_counts), list(bm._free), [list(s.block_table) for s in seqs],
            [bm._num_cached.get(s.seq_id) for s in seqs], len(bm._num_cached),
            None if cache is None else (
                sorted((b, n.last_access, n.is_evictable) for b, n in cache._nodes.items()),
                cache.num_evictable_blocks,
                sorted((a, n.block) for a, _, n in cache._lru), cache.stats.num_evicted_blocks))


def _free_block_by_block(bm: BlockManager, seq: Sequence) -> None:
    for block in reversed(seq.block_table):
        bm._release(block)
    seq.block_table = []
    bm._num_cached.pop(seq.seq_id, None)
    bm._drop_cursor.pop(seq.seq_id, None)


def _twin_seq(prompt: list[int]) -> tuple[Sequence, Sequence]:
    params = SamplingParams(max_tokens=10_000)
    return tuple(Sequence("r", 0, prompt, params, RequestTimings(0.0), 10_000)
                 for _ in range(2))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("caching", [True, False])
def test_decode_allocation_and_free_fast_paths_equal_the_general_ones(seed, caching):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(24, 80)
    fast, slow = BlockManager(num_blocks, bs, caching), BlockManager(num_blocks, bs, caching)
    prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    live: list[tuple[Sequence, Sequence]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.25 and len(live) < 6:  # admit: prefix match, the whole prompt in one chunk
            prompt = list(rng.choice(prompts)) + [rng.randrange(5)
                                                  for _ in range(rng.randint(0, 8))]
            a, b = _twin_seq(prompt)
            ma, mb = fast.match_prefix(a), slow.match_prefix(b)
            n = a.num_tokens - ma.num_tokens
            if not fast.can_allocate(a, n, match=ma):
                continue
            assert slow.can_allocate(b, n, match=mb)
            fast.allocate(a, n, ma)
            slow.allocate(b, n, mb)
            for s in (a, b):
                s.num_computed_tokens = s.num_tokens - 1  # the chunk ran; one to decode
            live.append((a, b))
        elif op < 0.8 and live:  # decode one token of a live sequence
            a, b = rng.choice(live)
            if not fast.can_allocate(a, 1):
                continue
            fast.allocate_decode(a)
            slow.allocate(b, 1)
            tok = rng.randrange(5)
            for s in (a, b):
                s.num_computed_tokens += 1
                s.append_token(tok)
        elif live:  # finish one
            a, b = live.pop(rng.randrange(len(live)))
            fast.free(a)
            _free_block_by_block(slow, b)
        assert _state(fast, [a for a, _ in live]) == _state(slow, [b for _, b in live])
        fast.check_invariants([a for a, _ in live])
    if caching:
        assert fast.prefix_cache.num_cached_blocks > 0


def test_allocate_decode_refuses_what_allocate_refuses():
    bm = BlockManager(2, 4)
    a, _ = _twin_seq([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    a.append_token(3)
    with pytest.raises(RuntimeError, match="without can_allocate"):
        bm.allocate_decode(a)


def test_a_double_free_is_still_an_error():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = _twin_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    b.block_table = list(a.block_table)  # a table the manager never gave b
    bm.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(b)


def test_the_blocks_in_use_never_spread_past_the_most_ever_held():
    """Whatever order requests finish in, a freed block is reused before a block nobody has
    held: after many sequences of random lengths have come and gone, every id ever taken lies
    below the most blocks held at once (a first-in-first-out list walks the whole pool), and
    a freed sequence's blocks go to the next one in its table order."""
    rng = random.Random(3)
    bm = BlockManager(num_blocks=4096, block_size=16)
    live: list[Sequence] = []
    highest_taken = most_held = 0
    for i in range(600):
        if live and (len(live) >= 24 or rng.random() < 0.5):
            gone = live.pop(rng.randrange(len(live)))
            table = list(gone.block_table)
            bm.free(gone)
            assert list(bm._free)[:len(table)] == table
        prompt = [rng.randrange(1, 50_000) for _ in range(rng.randrange(20, 400))]
        seq = Sequence(f"r{i}", i, prompt, SamplingParams(max_tokens=10), RequestTimings(0.0),
                       10_000)
        assert bm.can_allocate(seq, len(prompt))
        bm.allocate(seq, len(prompt))
        live.append(seq)
        bm.check_invariants(live)
        highest_taken = max(highest_taken, *seq.block_table)
        most_held = max(most_held, sum(len(s.block_table) for s in live))
    assert highest_taken < most_held < 24 * 25
