"""A model-free Runner for engine tests: deterministic tokens, no tensors.

It implements the same protocol as ModelRunner (servelm/core/contract.py): it keeps its own
sequences from each StepDescription's deltas (servelm/core/runner_state.py) and returns the
one StepResult type, so an engine test exercises the real boundary.
"""

import time

from servelm.core.contract import SampledToken, StepDescription, StepResult
from servelm.core.runner_state import RunnerState


class FakeRunner:
    """Token = a hash of the sequence's tokens so far: output depends only on the sequence,
    never on the batch, as greedy decoding of a real model would (up to float noise)."""

    def __init__(self, vocab_size: int = 1000, step_s: float = 0.0,
                 fail_after: int | None = None, block_size: int | None = None):
        self.vocab_size = vocab_size
        self.step_s = step_s  # simulated step time
        self.fail_after = fail_after  # raise on the step after this many
        self.block_size = block_size  # when set, check each step's slots exist
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.released: list[int] = []
        self.state = RunnerState(on_forget=self.released.append)

    def next_token(self, token_ids) -> int:
        return hash(tuple(token_ids)) % (self.vocab_size - 10) + 10

    def execute(self, step: StepDescription) -> StepResult:
        self.num_steps += 1
        if self.fail_after is not None and self.num_steps > self.fail_after:
            raise RuntimeError("boom")
        if self.step_s:
            time.sleep(self.step_s)
        self.num_tokens_computed += step.num_batched_tokens
        out = []
        for s in self.state.apply(step):
            self.check_slots(s)
            if s.is_sampling:
                out.append(SampledToken(s.seq.seq_id, self.next_token(s.seq.token_ids)))
        return StepResult(out)

    def check_slots(self, s) -> None:
        """The runner's view agrees with the step: the tokens it computes exist and (when
        the block size is known) every KV slot it writes has a block."""
        seq = s.seq
        assert s.start + s.num_new_tokens - s.num_spec <= seq.num_tokens, (s, seq.num_tokens)
        if self.block_size is not None:
            assert len(seq.block_table) * self.block_size >= s.start + s.num_new_tokens


def make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                max_model_len=512, chunked=True, prefix_caching=False, runner=None):
    from servelm.config import SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine

    return Engine(runner or FakeRunner(block_size=block_size), None,
                  BlockManager(num_blocks, block_size, prefix_caching),
                  SchedulerConfig(max_num_batched_tokens, max_num_seqs, chunked),
                  max_model_len, 1000, (1,))
