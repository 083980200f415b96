"""Scheduler: decides, each step, which sequences run and how many tokens each computes.

Owns: the waiting and running queues, the per-step token budget, preemption. Never: tensors,
model code, or finish decisions about text (the Engine's update step makes those).

One step = one token budget (`max_num_batched_tokens`) and at most `max_num_seqs` sequences:
running sequences first (decodes, or the next chunk of a prompt already started), then
waiting ones in arrival order, each taking as many prompt tokens as the budget leaves
(chunked prefill). When blocks run out, the youngest running sequence is preempted
(its KV dropped, recomputed later).

With LoRA on (`loras`, servelm/lora/slots.py), a waiting sequence with an adapter is admitted
only when its adapter is resident or can be made resident (a free slot, or an unpinned one to
evict); one that cannot waits in place while the sequences behind it are considered. A
running sequence pins its adapter's slot; preemption and finishing unpin it.

Under the SLO policy's rationing of background work (servelm/engine/slo_policy.py `hold`):
held running rows sit the step out with their blocks kept, waiting background prompts start
only as the policy allows, and a sequence of a higher class that needs blocks or a seat
takes them from background rows first (the youngest not in the step; one preempted for a
waiting head waits behind it). A step the rationing would leave empty is scheduled again
without it: held work runs rather than the engine idling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.kv_connector import KVConnector, NoKVConnector
from servelm.engine.sequence import Sequence, SequenceStatus
from servelm.vision.budget import EncoderBudget


class Speculator(Protocol):
    """What the scheduler and engine ask of a speculative-decoding controller
    (servelm/spec/controller.py: SpecController)."""

    last_k: int  # draft tokens per sequence chosen for the last step (0: off)

    def eligible(self, seq: Sequence) -> bool: ...

    def draft_len(self, num_decodes: int) -> int:
        """k for a step in which num_decodes sequences could speculate."""
        ...

    def observe_step(self, target_s: float, decode: int = 0, verify: int = 0,
                     prefill: int = 0) -> None: ...

    def observe_verify(self, proposed: int, accepted: int) -> None: ...

    def observe_draft(self, num_asked: int, draft_s: float, step_s: float,
                      num_proposed_seqs: int | None = None) -> None: ...


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens before)
    num_new_tokens: int  # positions budgeted and given KV slots (incl. num_spec)
    num_spec: int = 0  # of which draft tokens a proposer may fill (speculative decoding)

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the sequence's last token, so a next token is sampled."""
        return self.start + self.num_new_tokens - self.num_spec == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    """What one step schedules, over the engine's own Sequences; Engine.describe turns it
    into the plain StepDescription a runner gets (servelm/core/contract.py)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 speculator: Speculator | None = None, max_model_len: int | None = None,
                 loras=None, kv_connector: KVConnector | None = None):
        self.config = config
        self.loras = loras  # servelm.lora.LoraSlots, or None (LoRA off)
        self.block_manager = block_manager
        # Speculative decoding (servelm/spec/controller.py): how many draft slots a decode
        # gets this step; None: never speculate.
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new work, so that sequences already running
        # can grow by a block without immediately preempting what was just admitted.
        self.admission_reserve = max(1, block_manager.num_blocks // 100)
        # KV from outside the pool (servelm/engine/kv_connector.py, e.g. the host/disk tiers):
        # a waiting sequence's prefix found there is loaded with its admission, or it waits,
        # skipped, while its blocks are fetched.
        self.kv_connector = kv_connector or NoKVConnector()
        # Vision encoder work a step may start, in image tokens (servelm/vision/budget.py)
        self.encoder_budget = EncoderBudget(config.max_num_encoder_tokens)
        # A scheduling policy beside FCFS (servelm/engine/slo_policy.py; None: FCFS): it
        # orders the waiting queue and may cap this step's prompt tokens (_prefill_left).
        self.policy = None
        self._prefill_left: int | None = None
        self._pause_prefills = False  # this step's cap goes to the waiting queue's head
        self._ration = None  # this step's rationing of background work (SLOPolicy.hold)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.encoder_budget.reset()
        self._pause_prefills = False
        self._ration = None
        if self.policy is not None:
            self.policy.order(self.waiting, self.running, self.config.max_num_batched_tokens)
            self._ration = self.policy.hold(self.running, self.waiting)
            if self.config.enable_chunked_prefill:
                self._cap_prefill()
                # a waiting request that orders first takes this step's prompt tokens
                self._pause_prefills = self.policy.waiting_first(
                    self.running, self.waiting, self.config.max_num_batched_tokens)
        paused: list[Sequence] = []
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, paused)
        if not batch.preempted:
            num_running = len(self.running)
            budget = self._schedule_waiting(batch, budget)
            if paused and len(self.running) == num_running:
                # The head the prefills paused for was not admitted (no blocks or seat for
                # it yet): they go on, or the step would idle with them holding the blocks.
                self._resume_paused(batch, paused, budget)
        if batch.is_empty and not batch.preempted and self._ration is not None:
            self._unrationed(batch)
        return batch

    def _cap_prefill(self) -> None:
        """This step's prompt tokens: the policy's chunk cap for the decodes that run (held
        rows sit the step out), within what the ration leaves background prompts."""
        ration, running = self._ration, self.running
        if ration is not None and ration.held:
            running = [s for s in running if id(s) not in ration.held]
        self._prefill_left = self.policy.prefill_cap(
            running, self.config.max_num_batched_tokens, self.waiting)
        bg = ration.prompt_tokens if ration is not None else None
        if bg is not None:
            self._prefill_left = bg if self._prefill_left is None else min(bg, self._prefill_left)

    def _unrationed(self, batch: ScheduledBatch) -> None:
        """Schedule the (empty) step again without the ration: nothing of a higher class
        could run (it waits for blocks, a seat, an adapter or its KV), and holding the
        background work too would only idle the engine."""
        self._ration = None
        self.policy.unhold()
        self._pause_prefills = False
        if self.config.enable_chunked_prefill:
            self._cap_prefill()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)

    def _take_prefill(self, num_new: int) -> int:
        """Prompt tokens a running sequence may compute this step within the policy's chunk
        cap, or none while the cap goes to the waiting queue's head (called only under a
        policy: FCFS steps pay nothing for it)."""
        if num_new <= 1:
            return num_new
        if self._pause_prefills:
            return 0
        if self._prefill_left is None:
            return num_new
        num_new = min(num_new, self._prefill_left)
        self._prefill_left -= num_new
        return num_new

    def _schedule_running(self, batch: ScheduledBatch, budget: int,
                          paused: list[Sequence] | None = None) -> int:
        k_step = self._draft_len()
        held = self._ration.held if self._ration is not None else ()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if held and id(seq) in held:
                i += 1  # background held for the higher classes: its blocks kept
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._prefill_left is not None or self._pause_prefills:
                num_new = self._take_prefill(num_new)
            if num_new == 0:  # the policy's chunk cap is spent: this prefill waits a step
                if self._pause_prefills and paused is not None:
                    paused.append(seq)
                i += 1
                continue
            if seq.images:
                num_new = self.encoder_budget.fit(seq, seq.num_computed_tokens, num_new, False)
                if num_new == 0:  # its next image waits for a step with encoder budget
                    i += 1
                    continue
            spec = self._spec_slots(seq, k_step, budget) if num_new == 1 else 0
            if spec and not self.block_manager.can_allocate(seq, 1 + spec):
                spec = 0  # no room for drafts: a plain decode, rather than preempt for them
            num_new += spec
            while not self.block_manager.can_allocate(seq, num_new):
                if self._ration is None:
                    victim = self.running.pop()  # youngest: the tail of the running list
                else:
                    victim, i = self._rationed_victim(batch, i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return budget
            self.block_manager.allocate(seq, num_new)
            batch.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, spec))
            budget -= num_new
            i += 1
        return budget

    def _rationed_victim(self, batch: ScheduledBatch, i: int) -> tuple[Sequence, int]:
        """Under a ration, the sequence to preempt for blocks (taken out of the running
        list) and the index the running pass goes on from: the youngest background row
        not in this step (it may sit before index i, held), else the youngest."""
        victim = self._background_victim(batch)
        if victim is None:
            return self.running.pop(), i
        j = next(k for k in range(len(self.running) - 1, -1, -1)
                 if self.running[k] is victim)
        del self.running[j]
        return victim, i - 1 if j < i else i

    def _background_victim(self, batch: ScheduledBatch) -> Sequence | None:
        """The youngest running background row that this step does not carry."""
        carried = {id(s.seq) for s in batch.seqs}
        return next((s for s in reversed(self.running)
                     if self._ration.is_background(s) and id(s) not in carried), None)

    def _displace_background(self, batch: ScheduledBatch, skipped: list[Sequence]) -> bool:
        """Preempt a background row for the higher-class head of the waiting queue (its
        seat and blocks); the victim waits behind that head. False: none to preempt."""
        victim = self._background_victim(batch)
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        batch.preempted.append(victim)
        skipped.append(self.waiting.popleft())  # _preempt put it at the head
        return True

    def _resume_paused(self, batch: ScheduledBatch, paused: list[Sequence],
                       budget: int) -> None:
        """Schedule the prefills paused for a waiting head that was not admitted, within
        what is left of the budget and the policy's cap. One that needs blocks preempts as
        the first pass does, the youngest first, but never a sequence this step already
        carries."""
        self._pause_prefills = False
        carried = {id(s.seq) for s in batch.seqs}
        for seq in paused:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted for an older one
                continue
            num_new = self._take_prefill(min(seq.num_uncomputed_tokens, budget))
            if num_new and seq.images:
                num_new = self.encoder_budget.fit(seq, seq.num_computed_tokens, num_new, False)
            if num_new == 0:
                continue
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self._background_victim(batch) if self._ration is not None else None
                if victim is None:
                    victim = next(s for s in reversed(self.running) if id(s) not in carried)
                self.running.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                batch.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
                carried.add(id(seq))
                budget -= num_new

    def _draft_len(self) -> int:
        """k for this step, from the number of decodes that could speculate."""
        if self.speculator is None:
            return 0
        eligible = sum(1 for s in self.running
                       if s.num_uncomputed_tokens == 1 and self.speculator.eligible(s))
        return self.speculator.draft_len(eligible) if eligible else 0

    def _spec_slots(self, seq: Sequence, k: int, budget: int) -> int:
        """Draft slots for a decode: k, within the budget, the output limit (a step emits
        up to k + 1 tokens) and the context."""
        if k <= 0 or not self.speculator.eligible(seq):
            return 0
        k = min(k, budget - 1, seq.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return max(0, k)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """After verification: KV is valid below `num_computed` only; give back the blocks
        that held nothing but rejected drafts (never shared: drafts are not in the prefix
        cache until accepted)."""
        seq.num_computed_tokens = num_computed
        self.block_manager.trim(seq, num_computed)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        """Admit waiting sequences in order; returns the budget left."""
        # their adapter has no slot this step, or their KV is being fetched: they keep places
        skipped: list[Sequence] = []
        try:
            return self._admit_waiting(batch, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, batch: ScheduledBatch, budget: int,
                       skipped: list[Sequence]) -> int:
        ration = self._ration
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            fore = ration is not None and not ration.is_background(seq)
            if ration is not None and not fore and not self.policy.may_admit(
                    ration, seq, self.config.enable_chunked_prefill):
                skipped.append(self.waiting.popleft())  # background: no headroom for it
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if fore and self._displace_background(batch, skipped):
                    continue
                break
            if seq.lora_id is not None and not self.loras.can_acquire(seq.lora_id):
                skipped.append(self.waiting.popleft())
                continue
            match = self.block_manager.match_prefix(seq)
            load = self.kv_connector.plan_load(seq, match)
            if load is not None and load.is_pending:
                skipped.append(self.waiting.popleft())
                continue
            num_loaded = load.num_blocks * self.block_manager.block_size if load else 0
            num_new = seq.num_uncomputed_tokens - match.num_tokens - num_loaded
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self._prefill_left is not None and num_new > max(1, self._prefill_left):
                if self._prefill_left <= 0:
                    break  # the policy's chunk cap is spent
                num_new = self._prefill_left
            if seq.images:
                num_new = self.encoder_budget.fit(seq, seq.num_computed_tokens + match.num_tokens,
                                                  num_new, True)
                if num_new == 0:  # its first image waits for a step with encoder budget
                    break
            reserve = self.admission_reserve if self.running else 0
            if not self.block_manager.can_allocate(seq, num_loaded + num_new, reserve, match):
                if fore and self._displace_background(batch, skipped):
                    continue  # looked at afresh: its prefix match may have changed
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_loaded + num_new, match)
            if self._prefill_left is not None and num_new > 1:
                self._prefill_left -= num_new
            if seq.lora_id is not None:
                self.loras.acquire(seq.lora_id)
            if seq.status == SequenceStatus.WAITING:  # first admission, not a resume
                seq.num_cached_tokens = match.num_tokens
                seq.timings.num_cached_tokens = max(seq.timings.num_cached_tokens,
                                                    match.num_tokens)
            if load is not None:  # the loaded blocks' bytes go with this step
                self.kv_connector.on_admitted(seq, len(match.blocks), load)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.loras is not None and seq.lora_id is not None:
            self.loras.release(seq.lora_id)
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
            if self.loras is not None and seq.lora_id is not None:
                self.loras.release(seq.lora_id)
        elif not seq.is_finished:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)

    def live_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
