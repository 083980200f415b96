"""KV events: a listener that replays a prefix cache's events holds exactly the chain hashes
of the blocks the cache holds, after any sequence of inserts, releases and evictions."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.engine.prefix_cache import STORED, PrefixCache, block_hashes
from servelm.router.replicas import Replica


def _cached_hashes(cache: PrefixCache) -> set[int]:
    out, stack = set(), list(cache._roots.values())
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out.add(child.hash)
            stack.append(child)
    return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), enable_at=st.integers(0, 10),
       ops=st.lists(st.sampled_from(["insert", "release", "evict"]), min_size=1,
                    max_size=60))
def test_a_replayed_view_equals_the_cache(seed, enable_at, ops):
    rng = random.Random(seed)
    cache = PrefixCache(block_size=4)
    view = Replica("http://replica")
    next_block, held = 0, []
    for step, op in enumerate(ops):
        if step == enable_at:
            cache.enable_events()  # late: what is cached already is reported as stored
        if op == "insert":
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            tokens = base + [rng.randrange(10, 14) for _ in range(rng.randint(0, 12))]
            n = len(tokens) // 4
            blocks = list(range(next_block, next_block + n))
            next_block += n
            salt = rng.choice([None, None, "t"])
            got = cache.insert(tokens, blocks, salt)
            for b in blocks[:got]:
                if cache.contains(b) and b not in held:
                    held.append(b)
        elif op == "release":
            # As the BlockManager does: a block is released only after its descendants.
            free = [b for b in held
                    if all(c.is_evictable for c in cache._nodes[b].children.values())]
            if free:
                b = rng.choice(free)
                held.remove(b)
                cache.set_evictable(b, True)
        elif op == "evict":
            cache.evict(rng.randint(1, 4))
        if cache.record_events:
            events = cache.drain_events()
            view.apply_kv_events({"events": [list(e) for e in events], "next": 0,
                                  "block_size": 4})
            assert view.cache_view == _cached_hashes(cache)
    cache.check_invariants()


def test_the_hashes_a_router_computes_are_the_ones_the_cache_reports():
    cache = PrefixCache(block_size=4)
    cache.enable_events()
    prompt = list(range(50, 70))
    cache.insert(prompt, [3, 1, 4, 1 + 4, 9], "salt")
    stored = [h for kind, h, _ in cache.drain_events() if kind == STORED]
    assert stored == block_hashes(prompt, 4, "salt")
    assert block_hashes(prompt, 4, "salt") != block_hashes(prompt, 4, None)
    view = Replica("r", block_size=4, cache_view=set(stored))
    assert view.cached_tokens(block_hashes(prompt + [1, 2, 3, 4], 4, "salt")) == 20
    assert view.cached_tokens(block_hashes([0] + prompt, 4, "salt")) == 0
