"""Proposer: the interface every draft source implements, and the registry of names.

A proposer is asked, once per step, for up to `num_spec` draft tokens for each speculating
sequence (RunnerScheduled.num_spec: the slots the scheduler budgeted). It may return fewer
(n-gram: no match) or none. The KV slots for positions start .. start + num_spec already
exist in the sequence's block table when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    token_ids: list[int]
    # [len(token_ids), V] the draft distribution each token was drawn from, for rejection
    # sampling of sampled requests; None: a point mass (n-gram, or a greedy draft).
    probs: torch.Tensor | None = None
    # a tree (servelm/spec/tree.py): token_ids[i] is node i + 1, its parent parents[i]
    # (0: the token fed this step; parents before children); None: a chain
    parents: list[int] | None = None


class Proposer:
    name = "base"
    # target layers whose hidden states the proposer reads (EAGLE-3); () reads none, and
    # the target's steps keep their fast paths
    aux_layers: tuple[int, ...] = ()

    def observe(self, works: list, query_start_loc: list[int], aux: list) -> None:
        """After a target forward run with `aux_layers`: works[i]'s rows of each aux hidden
        state are query_start_loc[i] .. query_start_loc[i + 1] - 1."""

    def propose(self, scheduled: list) -> dict[int, Proposal]:
        """scheduled: RunnerScheduled items with num_spec > 0 -> seq_id -> Proposal."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """The sequence finished: drop any state kept for it."""
