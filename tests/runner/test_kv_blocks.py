"""KV blocks leaving and entering a runner's pool (StepDescription.kv_saves / kv_loads):
the byte layout round-trips for every cache kind, and a sequence whose prompt KV was
computed in one runner continues in another exactly as it would have in the first."""

import pytest
import torch

from servelm.attention.kv_cache import KVCache
from servelm.config import ModelConfig
from servelm.core.contract import (KVBlock, NewSequence, ScheduledSequence, StepDescription)
from servelm.protocol import SamplingParams
from tiny_models import make_tiny_engine, make_tiny_hf_model

DENSE = ModelConfig("llama", 32, 64, 128, 2, 4, 2, 16, 256)


def _filled(cache: KVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in (cache.k, cache.v):
        if pool.numel():
            src = torch.randn(pool.shape, generator=g)
            pool.copy_(src.to(pool.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_block_bytes_round_trip(dtype):
    a = KVCache(DENSE, 8, 4, dtype, torch.device("cpu"))
    b = KVCache(DENSE, 8, 4, dtype, torch.device("cpu"))
    _filled(a, 0)
    _filled(b, 1)
    assert a.block_nbytes == KVCache.bytes_per_block(DENSE, 4, dtype)
    data = a.read_block(3)
    assert len(data) == a.block_nbytes
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 (fp8 has no equality op on the CPU)
    neighbours = u8(b.k[:, 20:24]).clone(), u8(b.v[:, 28:32]).clone()
    b.write_block(6, data)
    assert torch.equal(u8(b.k[:, 24:28]), u8(a.k[:, 12:16]))
    assert torch.equal(u8(b.v[:, 24:28]), u8(a.v[:, 12:16]))
    assert torch.equal(u8(b.k[:, 20:24]), neighbours[0])
    assert torch.equal(u8(b.v[:, 28:32]), neighbours[1])
    assert b.read_block(6) == data


def test_mla_block_round_trip():
    mla = ModelConfig("deepseek2", 32, 64, 128, 2, 4, 4, 16, 256, kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    a = KVCache(mla, 4, 4, torch.float32, torch.device("cpu"))
    b = KVCache(mla, 4, 4, torch.float32, torch.device("cpu"))
    _filled(a, 2)
    assert a.block_nbytes == 2 * 4 * (32 + 8) * 4  # layers x slots x entry x fp32
    b.write_block(0, a.read_block(2))
    assert torch.equal(b.k[:, 0:4], a.k[:, 8:12])


def test_bad_block_is_refused():
    cache = KVCache(DENSE, 4, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="bytes"):
        cache.write_block(0, b"\0" * (cache.block_nbytes - 1))
    with pytest.raises(ValueError, match="block_id 4"):
        cache.read_block(4)


def _decode(runner, seq_id, step_id, token, start, blocks_kept, new_blocks=()):
    out = runner.execute(StepDescription(step_id, [ScheduledSequence(
        seq_id, start, 1, [token], blocks_kept, list(new_blocks))]))
    (s,) = out.sampled
    return s


def test_sequence_continues_in_another_runner():
    """Prompt KV computed in runner A, its full blocks saved and loaded into other block ids
    of runner B, which recomputes only the last prompt token: B's greedy continuation and
    logprobs equal A's."""
    hf = make_tiny_hf_model("llama")
    a = make_tiny_engine(hf, num_blocks=16, block_size=4).runner
    b = make_tiny_engine(hf, num_blocks=16, block_size=4).runner
    prompt = [(7 * i + 3) % 384 for i in range(14)]  # 3 full blocks + 2 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    first = a.execute(StepDescription(1, [ScheduledSequence(
        1, 0, 14, prompt, 0, [9, 2, 11, 4], new=NewSequence(params, 14))])).sampled[0]
    saved = a.execute(StepDescription(2, [], kv_saves=[9, 2, 11])).kv_saved
    assert [blk.block_id for blk in saved] == [9, 2, 11]

    # B: 12 positions' KV arrive as blocks 0, 5, 3; positions 12-13 are computed here
    loads = [KVBlock(dst, blk.data) for dst, blk in zip((0, 5, 3), saved)]
    b_first = b.execute(StepDescription(1, [ScheduledSequence(
        1, 12, 2, prompt, 0, [0, 5, 3, 8], new=NewSequence(params, 14))],
        kv_loads=loads)).sampled[0]
    assert b_first.token_id == first.token_id
    assert b_first.logprob.logprob == pytest.approx(first.logprob.logprob, abs=1e-5)

    ta, tb = first, b_first
    for i in range(6):
        pos = 14 + i
        grow_a = [6] if pos == 16 else []
        grow_b = [1] if pos == 16 else []
        ta = _decode(a, 1, 3 + i, ta.token_id, pos, 4 if pos <= 16 else 5, grow_a)
        tb = _decode(b, 1, 2 + i, tb.token_id, pos, 4 if pos <= 16 else 5, grow_b)
        assert tb.token_id == ta.token_id
        assert tb.logprob.logprob == pytest.approx(ta.logprob.logprob, abs=1e-5)


def test_without_the_loads_the_continuation_differs():
    """The check above can fail: B with the same block table but no loaded KV (zeros where
    the prompt's KV should be) gives different logprobs."""
    hf = make_tiny_hf_model("llama")
    a = make_tiny_engine(hf, num_blocks=16, block_size=4).runner
    b = make_tiny_engine(hf, num_blocks=16, block_size=4).runner
    prompt = [(7 * i + 3) % 384 for i in range(14)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    first = a.execute(StepDescription(1, [ScheduledSequence(
        1, 0, 14, prompt, 0, [9, 2, 11, 4], new=NewSequence(params, 14))])).sampled[0]
    b_first = b.execute(StepDescription(1, [ScheduledSequence(
        1, 12, 2, prompt, 0, [0, 5, 3, 8], new=NewSequence(params, 14))])).sampled[0]
    assert b_first.logprob.logprob != pytest.approx(first.logprob.logprob, abs=1e-5)


def test_fake_runner_blocks_hold_their_tokens():
    from fake_runner import FakeRunner

    r = FakeRunner(block_size=4)
    params = SamplingParams(max_tokens=4)
    r.execute(StepDescription(1, [ScheduledSequence(
        1, 0, 6, [10, 11, 12, 13, 14, 15], 0, [3, 1], new=NewSequence(params, 6))]))
    assert r.block_tokens(3) == [10, 11, 12, 13] and r.block_tokens(1) == [14, 15, -1, -1]
    (saved,) = r.execute(StepDescription(2, [], kv_saves=[3])).kv_saved
    other = FakeRunner(block_size=4)
    other.execute(StepDescription(1, [], kv_loads=[KVBlock(0, saved.data)]))
    assert other.block_tokens(0) == [10, 11, 12, 13]
