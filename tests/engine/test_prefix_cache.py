"""Prefix caching: a shared prefix is prefilled once, found again across turns, branches,
n > 1 and preemption; salts isolate tenants; eviction never starves admission."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_runner import make_engine
from servelm.engine.prefix_cache import PrefixCache
from servelm.llm import LLM
from servelm.protocol import EngineRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", max_position_embeddings=4096)


def _llm(hf, **kw):
    from tiny_models import make_tiny_engine

    kw.setdefault("num_blocks", 1200)
    return LLM(engine=make_tiny_engine(hf, block_size=16, **kw))


def _run(llm, prompt, params=GREEDY):
    before = llm.engine.stats.num_computed_tokens
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return out, llm.engine.stats.num_computed_tokens - before


def test_shared_2000_token_prefix_is_computed_once(hf):
    rng = random.Random(0)
    prefix = [rng.randrange(384) for _ in range(2000)]
    a, b = prefix + [1, 2, 3], prefix + [7, 8, 9, 10]
    cached = _llm(hf)
    _, ran_a = _run(cached, a)
    out_b, ran_b = _run(cached, b)
    # 2000 // 16 = 125 full blocks are hits; only the rest of b and its decodes run.
    hit = 125 * 16
    assert out_b.timings.num_cached_tokens == hit
    assert ran_b == len(b) - hit + GREEDY.max_tokens - 1
    assert ran_a == len(a) + GREEDY.max_tokens - 1
    plain = _llm(hf, enable_prefix_caching=False)
    assert _run(plain, b)[0].outputs[0].token_ids == out_b.outputs[0].token_ids
    cached.engine.check_invariants()


def test_multi_turn_reuses_prompt_and_answer_blocks(hf):
    llm = _llm(hf)
    history = list(range(10, 90))
    for turn in range(3):
        out, ran = _run(llm, history)
        if turn:
            # Every full block of the previous turn's prompt + answer is found again.
            assert out.timings.num_cached_tokens == (prev_len // 16) * 16
        prev_len = len(history) + len(out.outputs[0].token_ids) - 1  # last token has no KV
        history = history + out.outputs[0].token_ids + [5, 6, 7, 8, 9]
    llm.engine.check_invariants()


def test_branches_share_the_prefix_blocks(hf):
    llm = _llm(hf)
    engine = llm.engine
    trunk = list(range(20, 84))  # 4 full blocks
    for rid, tail in (("x", [1, 2, 3]), ("y", [4, 5])):
        engine.add_request(EngineRequest(rid, trunk + tail, GREEDY))
    engine.step()  # both admitted in one step: y matches what x registers in that step
    x, y = sorted(engine.scheduler.running, key=lambda s: s.request_id)
    assert x.block_table[:4] == y.block_table[:4]
    assert all(engine.block_manager.ref_count(b) == 2 for b in x.block_table[:4])
    while engine.has_unfinished:
        engine.step()
    plain = _llm(hf, enable_prefix_caching=False)
    for tail in ([1, 2, 3], [4, 5]):
        assert (_run(plain, trunk + tail)[0].outputs[0].token_ids
                == _run(llm, trunk + tail)[0].outputs[0].token_ids)
    engine.check_invariants()


def test_n_choices_share_prompt_blocks(hf):
    llm = _llm(hf)
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    prompt = list(range(30, 30 + 65))  # 4 full blocks + 1 token
    out, ran = _run(llm, prompt, params)
    assert len(out.outputs) == 4
    # Prompt computed once (65) + 3 x the one token past the shared blocks + decodes.
    assert ran == 65 + 3 * 1 + 4 * 5


def test_cache_salt_isolates_tenants(hf):
    llm = _llm(hf)
    prompt = list(range(40, 140))
    _run(llm, prompt, SamplingParams(max_tokens=2, cache_salt="tenant-a"))
    out, _ = _run(llm, prompt, SamplingParams(max_tokens=2, cache_salt="tenant-b"))
    assert out.timings.num_cached_tokens == 0
    out, _ = _run(llm, prompt, SamplingParams(max_tokens=2, cache_salt="tenant-a"))
    assert out.timings.num_cached_tokens == 96


def test_preempted_sequence_finds_its_blocks_again():
    engine = make_engine(num_blocks=12, block_size=4, max_num_batched_tokens=64,
                         prefix_caching=True)
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, list(range(5, 17)) if rid == "a" else
                                         list(range(50, 62)), SamplingParams(
                                             max_tokens=20, ignore_eos=True)))
    hits_before = engine.block_manager.prefix_cache.stats.num_hit_tokens
    while engine.has_unfinished:
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache.stats.num_hit_tokens > hits_before


def test_eviction_never_starves_admission():
    engine = make_engine(num_blocks=16, block_size=4, max_num_batched_tokens=64,
                         prefix_caching=True)
    for i in range(40):  # 40 distinct 20-token prefixes through a 64-token pool
        engine.add_request(EngineRequest(f"r{i}", [100 + i] * 20, SamplingParams(
            max_tokens=4, ignore_eos=True)))
        while engine.has_unfinished:
            engine.step()
            engine.check_invariants()
    cache = engine.block_manager.prefix_cache
    assert cache.stats.num_evicted_blocks > 0
    assert engine.block_manager.num_free_blocks == 16


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 7),
                          st.integers(1, 30)), max_size=50))
def test_random_workloads_keep_the_tree_consistent(ops):
    engine = make_engine(num_blocks=20, block_size=4, max_num_batched_tokens=16,
                         prefix_caching=True)
    prefixes = [[7] * 8, [7] * 4 + [9] * 4, [3] * 12]
    n = 0
    for op, a, b in ops:
        if op == "add":
            prompt = prefixes[a % 3][: 4 + b % 9] + [a] * (b % 5)
            engine.add_request(EngineRequest(f"r{n}", prompt, SamplingParams(
                max_tokens=1 + b % 6, n=1 + a % 2, ignore_eos=True,
                cache_salt=None if a < 6 else "s")))
            n += 1
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif n:
            engine.abort(f"r{b % n}")
        engine.check_invariants()
    while engine.has_unfinished:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == 20


def test_match_respects_limit_and_whole_blocks():
    cache = PrefixCache(block_size=4)
    tokens = list(range(12))
    assert cache.insert(tokens, [5, 6, 7]) == 3
    assert cache.match(tokens).blocks == [5, 6, 7]
    assert cache.match(tokens, max_tokens=11).blocks == [5, 6]
    assert cache.match(tokens[:6] + [99] * 6).blocks == [5]
    assert cache.match(tokens, extra_key="other").blocks == []


def _serve(engine, prompt, salt, rid):
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(
        max_tokens=2, ignore_eos=True, cache_salt=salt)))
    while engine.has_unfinished:
        engine.step()


def test_a_namespace_goes_with_its_last_block():
    """A new salt per request must not leave a namespace behind once its blocks are evicted:
    the cache's bookkeeping stays O(KV pool), not O(salts ever seen)."""
    engine = make_engine(num_blocks=16, block_size=4, prefix_caching=True)
    cache = engine.block_manager.prefix_cache
    for i in range(300):
        _serve(engine, [i % 50 + 1] * 9, f"tenant-{i}-" + "x" * 200, f"r{i}")
        engine.check_invariants()
    usage = cache.usage()
    assert usage.num_namespaces <= usage.num_cached_blocks <= 16
    assert usage.num_bytes < 16 * 2000  # a few hundred bytes per block and salt, not 300 salts
    assert cache.stats.num_evicted_blocks > 0


def test_evicting_every_block_leaves_no_namespace():
    cache = PrefixCache(block_size=4)
    for i in range(10):
        cache.insert(list(range(8)), [2 * i, 2 * i + 1], extra_key=f"salt-{i}")
        for b in (2 * i, 2 * i + 1):
            cache.set_evictable(b, True)
    assert cache.num_namespaces == 10
    assert sorted(cache.evict(100)) == list(range(20))
    assert cache.usage() == (0, 0, 0, 0)
    cache.check_invariants()


def test_lru_heap_stays_bounded_when_nothing_is_evicted():
    """A hot prefix taken and released by every request leaves a stale heap entry each time;
    they are compacted instead of piling up while the pool never runs out."""
    engine = make_engine(num_blocks=64, block_size=4, prefix_caching=True)
    cache = engine.block_manager.prefix_cache
    for i in range(400):
        _serve(engine, [5] * 12 + [i % 7], None, f"r{i}")
    assert cache.stats.num_evicted_blocks == 0
    assert cache.usage().num_lru_entries <= 2 * 64 + 64
    engine.check_invariants()


def test_cache_salt_has_a_length_limit():
    from servelm.protocol import InvalidParameterError

    SamplingParams(cache_salt="s" * SamplingParams.MAX_CACHE_SALT_LEN)
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(cache_salt="s" * (SamplingParams.MAX_CACHE_SALT_LEN + 1))
    assert info.value.param == "cache_salt"
