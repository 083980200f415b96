"""ThinkingSteer: one sequence's thinking counted against its budget, and closed when spent.

Owns: following a sequence's output tokens through its thinking (ThinkingBudget in
servelm/protocol.py names the tags as token ids) and, once the budget is spent, the token to
append in place of the sampled one: the end tag's tokens one per step, after which the
model answers. The engine asks it about every sampled token of a budgeted sequence.
Never: reads text or knows a reasoning parser (the server turned the tags into ids), or
touches logits: the sampled token is replaced after sampling, so the runner, which learns a
sequence's tokens only from the engine's step deltas, computes KV for the forced token.

    budget 3, start <think> (one token here), end </think>:
      sampled  <think>  a  b  c  d        e  ...
      appended <think>  a  b  c  </think> e  ...   (d was the 4th thinking token: replaced)
"""

from __future__ import annotations

import enum

from servelm.protocol import ThinkingBudget


class _Phase(enum.Enum):
    OPENING = "opening"  # matching the start tag at the head of the output
    THINKING = "thinking"
    CLOSING = "closing"  # appending the end tag's tokens
    DONE = "done"  # the thinking closed (or never opened): tokens pass unchanged


class ThinkingSteer:
    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.phase = _Phase.OPENING if budget.start_token_ids else _Phase.THINKING
        self.num_thinking_tokens = 0  # sampled inside the block, the model's own end tag too
        self._num_matched = 0  # of the start tag (opening) or the end tag (thinking, closing)

    @property
    def is_done(self) -> bool:
        return self.phase is _Phase.DONE

    def next_token(self, sampled: int) -> int:
        """The token to append for `sampled` (itself, or the end tag's next token)."""
        if self.phase is _Phase.OPENING:
            return self._opening(sampled)
        if self.phase is _Phase.THINKING:
            if self.num_thinking_tokens >= self.budget.num_tokens:
                self.phase, self._num_matched = _Phase.CLOSING, 0
                return self._closing()
            self.num_thinking_tokens += 1
            self._follow_end_tag(sampled)
            return sampled
        if self.phase is _Phase.CLOSING:
            return self._closing()
        return sampled

    def _opening(self, sampled: int) -> int:
        start = self.budget.start_token_ids
        if sampled != start[self._num_matched]:
            self.phase = _Phase.DONE  # the output does not open a thinking block
            return sampled
        self._num_matched += 1
        if self._num_matched == len(start):
            self.phase, self._num_matched = _Phase.THINKING, 0
        return sampled

    def _closing(self) -> int:
        end = self.budget.end_token_ids
        token = end[self._num_matched]
        self._num_matched += 1
        if self._num_matched == len(end):
            self.phase = _Phase.DONE
        return token

    def _follow_end_tag(self, sampled: int) -> None:
        """The model closed the block itself once its last tokens are the end tag's."""
        end = self.budget.end_token_ids
        if sampled == end[self._num_matched]:
            self._num_matched += 1
        else:  # a restart: the token may itself begin the tag
            self._num_matched = 1 if sampled == end[0] else 0
        if self._num_matched == len(end):
            self.phase = _Phase.DONE
