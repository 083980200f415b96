"""SequenceTokens: the token layout both sides of the step contract read a sequence by.

Owns: the counts derived from a sequence's `token_ids` and `num_prompt_tokens`, shared by the
engine's Sequence (servelm/engine/sequence.py) and the runner's RunnerSequence
(runner_state.py), so that proposers and the batch builder read either the same way. It
sits here, beside the contract, because both the engine and the runners build on it.
Never: holds state of its own (the subclasses own the slots), or imports torch.
"""

from __future__ import annotations


class SequenceTokens:
    """Token counts of a sequence from its `token_ids` and `num_prompt_tokens` (the engine's
    Sequence and the runner's RunnerSequence both hold them)."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
