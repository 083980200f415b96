"""Scheduler: decides, each step, which sequences run and how many tokens each computes.

Owns: the waiting and running queues, the per-step token budget, preemption. Never: tensors,
model code, or finish decisions about text (the Engine's update step makes those).

One step = one token budget (`max_num_batched_tokens`) and at most `max_num_seqs` sequences:
running sequences first (decodes, or the next chunk of a prompt already started), then
waiting ones in arrival order, each taking as many prompt tokens as the budget leaves
(chunked prefill). When blocks run out, the youngest running sequence is preempted
(its KV dropped, recomputed later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens before)
    num_new_tokens: int

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the sequence's last token, so a next token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    """What one step computes. Tensor-free; the runner turns it into a ForwardBatch."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new work, so that sequences already running
        # can grow by a block without immediately preempting what was just admitted.
        self.admission_reserve = max(1, block_manager.num_blocks // 100)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # youngest: the tail of the running list
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return budget
            self.block_manager.allocate(seq, num_new)
            batch.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = self.block_manager.match_prefix(seq)
            num_new = seq.num_uncomputed_tokens - match.num_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            reserve = self.admission_reserve if self.running else 0
            if not self.block_manager.can_allocate(seq, num_new, reserve, match):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new, match)
            if seq.status == SequenceStatus.WAITING:  # first admission, not a resume
                seq.num_cached_tokens = match.num_tokens
                seq.timings.num_cached_tokens = max(seq.timings.num_cached_tokens,
                                                    match.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        seq.timings.num_preemptions += 1
        self.num_preemptions += 1
        # Preempted work resumes before new arrivals. Victims are taken youngest first, so
        # pushing each to the front leaves the oldest at the head.
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        assert status.is_finished
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.is_finished:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)

    def live_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
