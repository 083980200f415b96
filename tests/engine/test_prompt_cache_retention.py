"""prompt_cache_retention: a retained prompt's blocks go last in the prefix cache's eviction
order (earliest expiry first) until the retention ends, at most a cap per tenant (its least
recently retained blocks un-pinned past it), and a pool full of retained blocks still serves
every request (retention is never a pin)."""

from __future__ import annotations

import pytest

from fake_runner import FakeRunner
from servelm.engine.prefix_cache import PrefixCache
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cache(cap: int = 8):
    clock = _Clock()
    cache = PrefixCache(block_size=2, max_retained_blocks=cap, clock=clock)
    for blocks, first in (([0, 1], 10), ([2, 3], 20), ([4, 5], 30)):  # oldest first
        cache.insert([first, first, first + 1, first + 1], blocks)
        cache.release(blocks)
    return cache, clock


def test_a_retained_prefix_is_evicted_after_every_unretained_one():
    cache, clock = _cache()
    assert cache.retain([0, 1], 60.0) == 2
    assert sorted(cache.evict(4)) == [2, 3, 4, 5]  # the oldest, retained, stays
    cache.check_invariants()
    assert cache.evict(2) == [1, 0]  # pressure left nothing else: retention is no pin
    assert cache.num_retained_blocks == 0
    cache.check_invariants()


def test_retention_ends_and_the_prefix_is_lru_again():
    cache, clock = _cache()
    cache.retain([0, 1], 60.0)
    clock.now += 61
    assert cache.evict(2) == [1, 0]


def test_the_cap_unpins_the_tenants_least_recently_retained_blocks():
    cache, clock = _cache(cap=3)
    assert cache.retain([0, 1], 60.0, "a") == 2
    clock.now += 1
    assert cache.retain([2, 3], 60.0, "a") == 2  # a's older prompt loses its tail (block 1)
    assert cache.retain([4, 5], 60.0, "b") == 2  # b's cap is its own: a's stays as it is
    assert cache.num_retained_by("a") == 3 and cache.num_retained_by("b") == 2
    cache.check_invariants()
    assert cache.evict(1) == [1]  # un-pinned: plain LRU again, and the oldest block
    assert cache.evict(1) == [0]  # then the retained ones, earliest expiry first
    assert sorted(cache.evict(4)) == [2, 3, 4, 5]
    cache.check_invariants()
    off = PrefixCache(block_size=2)  # no cap: retention off
    off.insert([1, 1], [0])
    assert off.retain([0], 60.0) == 0


def test_a_prompt_longer_than_the_cap_keeps_its_head():
    cache, clock = _cache(cap=1)
    assert cache.retain([0, 1], 60.0, "a") == 1  # the root, which longer prompts share
    assert cache.evict(5) == [1, 3, 2, 5, 4]
    assert cache.evict(1) == [0]
    cache.check_invariants()


def test_expired_retentions_make_room_before_live_ones():
    cache, clock = _cache(cap=2)
    cache.retain([0, 1], 60.0, "a")
    clock.now += 61
    assert cache.retain([2, 3], 60.0, "a") == 2
    cache.check_invariants()
    assert cache.evict(4) == [1, 0, 5, 4]  # a's expired prompt is plain LRU again


def test_bad_retention_is_refused_by_name():
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(prompt_cache_retention="1h")
    assert e.value.param == "prompt_cache_retention"
    assert SamplingParams(prompt_cache_retention="24h").cache_retention_s == 24 * 3600
    assert SamplingParams(prompt_cache_retention="in_memory").cache_retention_s == 0


def _engine(num_blocks: int, max_retained_blocks: int):
    from servelm.config import SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine

    return Engine(FakeRunner(block_size=4), None,
                  BlockManager(num_blocks, 4, True, max_retained_blocks=max_retained_blocks),
                  SchedulerConfig(64, 8, True), 512, 10000, (1,))


def _cached_tokens(engine, rid: str, prompt: list[int], retention: str | None = None,
                   tenant: str | None = None) -> int:
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_cache_retention=retention,
                            prompt_cache_tenant=tenant)
    engine.add_request(EngineRequest(rid, prompt, params))
    cached = None
    while engine.has_unfinished:
        for d in engine.step():
            if d.timings is not None:
                cached = d.timings.num_cached_tokens
        engine.check_invariants()
    return cached


@pytest.mark.parametrize("cap", [8, 0])
def test_a_retained_prompt_survives_pressure_that_evicts_an_unretained_one(cap):
    """cap 0: retention off, and the same pressure evicts both."""
    engine = _engine(num_blocks=24, max_retained_blocks=cap)
    kept, lost = list(range(1000, 1020)), list(range(2000, 2020))
    _cached_tokens(engine, "kept", kept, "24h")
    _cached_tokens(engine, "lost", lost)
    for i in range(6):  # distinct prompts, enough to evict every unretained block
        _cached_tokens(engine, f"p{i}", list(range(3000 + 100 * i, 3000 + 100 * i + 40)))
    # its 4 full prompt blocks (the 5th holds the last prompt token, computed again)
    assert _cached_tokens(engine, "kept2", kept) == (16 if cap else 0)
    assert _cached_tokens(engine, "lost2", lost) == 0


def test_each_tenant_keeps_its_latest_prompts_within_its_cap():
    """cap 5 blocks a tenant (one 20-token prompt): a's second prompt un-pins its first; b's
    stays retained beside a's."""
    engine = _engine(num_blocks=24, max_retained_blocks=5)
    first, second, other = ([base + i for i in range(20)] for base in (1000, 2000, 4000))
    _cached_tokens(engine, "a1", first, "24h", "project:a")
    _cached_tokens(engine, "a2", second, "24h", "project:a")
    _cached_tokens(engine, "b1", other, "24h", "project:b")
    cache = engine.block_manager.prefix_cache
    assert cache.num_retained_by("project:a") == cache.num_retained_by("project:b") == 5
    for i in range(6):
        _cached_tokens(engine, f"p{i}", list(range(5000 + 100 * i, 5000 + 100 * i + 40)))
    assert _cached_tokens(engine, "a2'", second) == 16
    assert _cached_tokens(engine, "b1'", other) == 16
    assert _cached_tokens(engine, "a1'", first) == 0
