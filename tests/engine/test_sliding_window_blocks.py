"""Blocks that leave a sliding window go back to the pool (BlockManager.drop_out_of_window):
a Mistral-style model (every layer slides over 8 keys, blocks of 4) holds a bounded number of
blocks however long it generates, the invariant holds after every step, and its greedy tokens
are transformers' alone, batched, with prefix-cache hits and after preemption."""

import pytest
import torch

from servelm.engine.block_manager import DROPPED, BlockManager
from servelm.engine.sequence import Sequence
from servelm.protocol import EngineRequest, RequestTimings, SamplingParams
from tiny_families import make_tiny_family_model
from tiny_models import make_tiny_engine

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def hf():
    return make_tiny_family_model("mistral_window")


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False,
            pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _held(seq) -> int:
    return sum(1 for b in seq.block_table if b != DROPPED)


def test_the_drop_rule_at_its_boundaries():
    bm = BlockManager(32, BS, sliding_window=WINDOW)
    seq = Sequence("r", 0, list(range(30)), SamplingParams(max_tokens=1), RequestTimings(), 1)
    bm.allocate(seq, 30)
    seq.num_computed_tokens = 30
    # next query at 30 reads 23..30: blocks 0..4 (positions 0..19) are dead, 5 (20..23) not
    assert bm.drop_out_of_window(seq) == 5
    assert seq.block_table[:6] == [DROPPED] * 5 + [seq.block_table[5]]
    assert bm.drop_out_of_window(seq) == 0  # nothing twice
    bm.check_invariants([seq])
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 32


def test_a_window_under_two_blocks_frees_nothing():
    assert BlockManager(8, 16, sliding_window=24).sliding_window == 0
    assert BlockManager(8, 4, sliding_window=0).drop_out_of_window(None) == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_long_generation_holds_a_bounded_number_of_blocks(hf, prefix_caching):
    engine = make_tiny_engine(hf, num_blocks=64, block_size=BS,
                              enable_prefix_caching=prefix_caching)
    assert engine.block_manager.sliding_window == WINDOW
    prompt = [(7 * i + 3) % hf.config.vocab_size for i in range(10)]
    engine.add_request(EngineRequest("r", prompt, SamplingParams(
        max_tokens=60, temperature=0, ignore_eos=True)))
    seq = engine.scheduler.waiting[0]
    tokens, most = [], 0
    while engine.has_unfinished:
        tokens += [t for d in engine.step() for t in d.token_ids]
        engine.check_invariants()
        if not seq.is_finished:
            most = max(most, _held(seq))
    # 70 positions would take 18 blocks. After a step the next query q reads q-7..q: the
    # blocks from the one holding q-8 to the one holding q-1, at most 3; the prompt's 2 full
    # blocks stay while they are in the prefix cache (shared), and go with it off.
    assert most == (3 + 2 if prefix_caching else 3)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert tokens == _hf_greedy(hf, prompt, 60)


def test_batched_prefix_hits_and_preemption_match_transformers(hf):
    prefix = [(5 * i + 1) % hf.config.vocab_size for i in range(12)]
    prompts = [prefix + [(11 * i + j) % hf.config.vocab_size for j in range(2 + 3 * i)]
               for i in range(5)]
    engine = make_tiny_engine(hf, num_blocks=24, block_size=BS, max_num_batched_tokens=9)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True)))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache.stats.num_hit_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for i, p in enumerate(prompts):
        assert out[str(i)] == _hf_greedy(hf, p, 30), i


def test_alternating_windows_keep_every_block():
    """Gemma-style layers (sliding and global alternating) still read old blocks."""
    hf = make_tiny_family_model("gemma2")
    engine = make_tiny_engine(hf, block_size=BS)
    assert engine.block_manager.sliding_window == 0
