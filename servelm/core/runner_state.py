"""The runner side of the step contract: sequences as a runner knows them.

Owns: RunnerSequence (token ids, block table, sampling parameters of one sequence, as the
deltas of each StepDescription built them), RunnerScheduled (its part of one step) and
RunnerState (applying a step's deltas). Shared by every Runner: the model runner, the test
fake and the simulator's runner.
Never: imports torch, or reads the engine's Sequence objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.core.contract import StepDescription
from servelm.core.sequence_tokens import SequenceTokens
from servelm.protocol import SamplingParams


class RunnerSequence(SequenceTokens):
    """What the runner knows of one sequence, built from step deltas (never the engine's
    Sequence): tokens so far, block table, sampling parameters. Proposers and the forward
    batch builder read it through the same attribute names as a Sequence."""

    __slots__ = ("seq_id", "token_ids", "block_table", "params", "seed", "num_prompt_tokens",
                 "num_computed_tokens", "num_resets", "lora_id")

    def __init__(self, seq_id: int, params: SamplingParams, num_prompt_tokens: int,
                 seed: int | None = None, token_ids: list[int] | None = None,
                 block_table: list[int] | None = None, lora_id: int | None = None):
        self.seq_id = seq_id
        self.lora_id = lora_id  # the LoRA adapter it runs with (None: the base model)
        self.params = params
        self.seed = seed
        self.num_prompt_tokens = num_prompt_tokens
        self.token_ids: list[int] = token_ids if token_ids is not None else []
        self.block_table: list[int] = block_table if block_table is not None else []
        self.num_computed_tokens = 0  # KV positions written before the current step
        self.num_resets = 0  # preemptions seen: KV kept elsewhere (a draft's) is stale


@dataclass
class RunnerScheduled:
    """One sequence's part of the step being executed (runner side)."""

    seq: RunnerSequence
    start: int
    num_new_tokens: int
    num_spec: int = 0

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the sequence's last token, so a next token is sampled."""
        return self.start + self.num_new_tokens - self.num_spec == self.seq.num_tokens


def score_item(token_ids: list[int], block_table: list[int], start: int,
               num_tokens: int) -> RunnerScheduled:
    """A one-off scoring of positions start .. start + num_tokens - 1 of `token_ids` (whose
    KV slots are `block_table`'s): for ModelRunner.score, outside the step path."""
    seq = RunnerSequence(-1, SamplingParams(max_tokens=1), len(token_ids), None,
                         list(token_ids), list(block_table))
    seq.num_computed_tokens = start
    return RunnerScheduled(seq, start, num_tokens)


class RunnerState:
    """The runner's sequences, kept in step with the scheduler by applying each step's
    deltas: finished ones forgotten, preempted ones without blocks, scheduled ones extended."""

    def __init__(self, on_forget=None, on_preempt=None):
        self.seqs: dict[int, RunnerSequence] = {}
        self._on_forget = on_forget
        self._on_preempt = on_preempt

    def apply(self, step: StepDescription) -> list[RunnerScheduled]:
        for seq_id in step.finished_seq_ids:
            if self.seqs.pop(seq_id, None) is not None and self._on_forget is not None:
                self._on_forget(seq_id)
        for seq_id in step.preempted_seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.block_table = []
                seq.num_computed_tokens = 0
                seq.num_resets += 1
                if self._on_preempt is not None:
                    self._on_preempt(seq_id)
        out = []
        for s in step.seqs:
            seq = self.seqs.get(s.seq_id)
            if seq is None:
                if s.new is None:
                    raise ValueError(f"step {step.step_id} schedules sequence {s.seq_id}, "
                                     "which this runner has never seen")
                seq = self.seqs[s.seq_id] = RunnerSequence(
                    s.seq_id, s.new.params, s.new.num_prompt_tokens, s.new.seed,
                    lora_id=s.new.lora_id)
            if s.new_token_ids:
                seq.token_ids += s.new_token_ids
            if s.num_kept_blocks != len(seq.block_table):
                del seq.block_table[s.num_kept_blocks:]
            if s.new_block_ids:
                seq.block_table += s.new_block_ids
            seq.num_computed_tokens = s.start
            out.append(RunnerScheduled(seq, s.start, s.num_new_tokens, s.num_spec))
        return out


__all__ = ["RunnerScheduled", "RunnerSequence", "RunnerState", "score_item"]
