"""Sequence: the one mutable per-sequence state the engine keeps.

Owns: token ids (prompt + output), how many of them have KV in the cache, the block table,
status. Never: tensors (the engine is plain Python so the simulator can run it).
"""

from __future__ import annotations

import enum
import itertools

from servelm.core.sequence_tokens import SequenceTokens
from servelm.protocol import FinishReason, RequestTimings, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, after its blocks were taken back
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}

_seq_ids = itertools.count()


class Sequence(SequenceTokens):
    """One generated continuation of a request (a request with n > 1 has n of them).

    Token layout (P prompt tokens, O output tokens, C computed = KV written):

        token_ids:  [p0 p1 ... pP-1 | o0 o1 ... oO-1]
                     <---- num_computed_tokens ---->?
    A decode step computes the one token past `num_computed_tokens` (the last sampled one);
    a prefill chunk computes several prompt tokens.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        timings: RequestTimings,
        max_tokens: int,
        extra_key: str | None = None,
        lora_id: int | None = None,
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (last admission)
        self.block_table: list[int] = []
        self.num_resets = 0  # preemptions so far: KV kept elsewhere (a draft's) is stale
        self.status = SequenceStatus.WAITING
        self.params = params
        self.timings = timings
        self.slo = None  # RequestSLO: the targets the SLO scheduling policy orders by
        self.max_tokens = max_tokens  # resolved: never None
        self.extra_key = extra_key  # prefix-cache namespace (cache_salt, adapter id)
        self.lora_id = lora_id  # the LoRA adapter it runs with (servelm/lora/slots.py)
        self.images: list = []  # the prompt's ImageInputs, in order (vision models)
        # Seed for this sequence's private sampling stream (n > 1 gets distinct streams).
        self.seed = None if params.seed is None else params.seed + index * 1_000_003

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def cache_token_ids(self) -> list[int]:
        """token_ids as the prefix cache keys them: an image's placeholder positions carry
        the image's content hash (servelm/vision/prompt.py), so equal text with another
        image matches nothing past it."""
        if not self.images:
            return self.token_ids
        from servelm.vision.prompt import cache_key_tokens

        return cache_key_tokens(self.token_ids, self.images)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; prompt + output so far is prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_resets += 1
        self.status = SequenceStatus.PREEMPTED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}#{self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
