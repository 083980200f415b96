"""A model-free Runner for engine tests: deterministic tokens, no tensors.

It implements the same protocol as ModelRunner (servelm/core/contract.py): it keeps its own
sequences from each StepDescription's deltas (servelm/core/runner_state.py) and returns the
one StepResult type, so an engine test exercises the real boundary.
"""

import struct
import time

from servelm.core.contract import KVBlock, SampledToken, StepDescription, StepResult
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
        # synthetic KV: block id -> the token id whose "KV" each slot holds (-1: never
        # written), so a block saved here and loaded elsewhere can be checked slot by slot
        self.blocks: dict[int, list[int]] = {}

    def next_token(self, token_ids) -> int:
        return hash(tuple(token_ids)) % (self.vocab_size - 10) + 10

    def execute(self, step: StepDescription) -> StepResult:
        self.num_steps += 1
        if self.fail_after is not None and self.num_steps > self.fail_after:
            raise RuntimeError("boom")
        if self.step_s:
            time.sleep(self.step_s)
        self.num_tokens_computed += step.num_batched_tokens
        scheduled = self.state.apply(step)
        kv_saved = [KVBlock(b, self.block_bytes(b)) for b in step.kv_saves]
        for block in step.kv_loads:
            self.load_block(block)
        out = []
        for s in scheduled:
            self.check_slots(s)
            self.write_kv(s)
            if s.is_sampling:
                out.append(SampledToken(s.seq.seq_id, self.next_token(s.seq.token_ids)))
        return StepResult(out, kv_saved=kv_saved)

    @property
    def block_nbytes(self) -> int:
        if self.block_size is None:
            raise ValueError("FakeRunner needs a block_size to move KV blocks")
        return 8 * self.block_size

    def block_tokens(self, block_id: int) -> list[int]:
        return self.blocks.get(block_id, [-1] * (self.block_nbytes // 8))

    def block_bytes(self, block_id: int) -> bytes:
        return struct.pack(f"<{self.block_nbytes // 8}q", *self.block_tokens(block_id))

    def load_block(self, block: KVBlock) -> None:
        if len(block.data) != self.block_nbytes:
            raise ValueError(f"KV block data is {len(block.data)} bytes, expected "
                             f"{self.block_nbytes}")
        self.blocks[block.block_id] = list(struct.unpack(f"<{self.block_nbytes // 8}q",
                                                         block.data))

    def write_kv(self, s) -> None:
        """Record which token's KV each computed slot now holds (draft slots excluded:
        their tokens are the proposer's, unknown here)."""
        if self.block_size is None:
            return
        seq, bs = s.seq, self.block_size
        for pos in range(s.start, min(s.start + s.num_new_tokens, seq.num_tokens)):
            block = seq.block_table[pos // bs]
            self.blocks.setdefault(block, [-1] * bs)[pos % bs] = seq.token_ids[pos]

    def check_slots(self, s) -> None:
        """The runner's view agrees with the step: the tokens it computes exist and (when
        the block size is known) every KV slot it writes has a block."""
        seq = s.seq
        assert s.start + s.num_new_tokens - s.num_spec <= seq.num_tokens, (s, seq.num_tokens)
        if self.block_size is not None:
            assert len(seq.block_table) * self.block_size >= s.start + s.num_new_tokens


def make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                max_model_len=512, chunked=True, prefix_caching=False, runner=None,
                kv_connector=None):
    from servelm.config import SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine

    return Engine(runner or FakeRunner(block_size=block_size), None,
                  BlockManager(num_blocks, block_size, prefix_caching),
                  SchedulerConfig(max_num_batched_tokens, max_num_seqs, chunked),
                  max_model_len, 1000, (1,), kv_connector=kv_connector)
