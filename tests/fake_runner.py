"""A model-free runner for engine tests: deterministic tokens, no tensors."""

import time
from dataclasses import dataclass


@dataclass
class _Sampled:
    seq_id: int
    token_id: int
    logprob: None = None


@dataclass
class _Result:
    sampled: list


class FakeRunner:
    """Token = a hash of the sequence's tokens so far: output depends only on the sequence,
    never on the batch, as greedy decoding of a real model would (up to float noise)."""

    def __init__(self, vocab_size: int = 1000, step_s: float = 0.0,
                 fail_after: int | None = None):
        self.vocab_size = vocab_size
        self.step_s = step_s  # simulated step time
        self.fail_after = fail_after  # raise on the step after this many
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.released: list[int] = []

    def execute(self, batch):
        self.num_steps += 1
        if self.fail_after is not None and self.num_steps > self.fail_after:
            raise RuntimeError("boom")
        if self.step_s:
            time.sleep(self.step_s)
        self.num_tokens_computed += batch.num_batched_tokens
        out = []
        for s in batch.seqs:
            assert s.seq.num_computed_tokens == s.start
            if s.is_sampling:
                h = hash(tuple(s.seq.token_ids)) % (self.vocab_size - 10) + 10
                out.append(_Sampled(s.seq.seq_id, h))
        return _Result(out)

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                max_model_len=512, chunked=True, prefix_caching=False, runner=None):
    from servelm.config import SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine

    return Engine(runner or FakeRunner(), None, BlockManager(num_blocks, block_size, prefix_caching),
                  SchedulerConfig(max_num_batched_tokens, max_num_seqs, chunked),
                  max_model_len, 1000, (1,))
