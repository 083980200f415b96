"""Speculative decoding: propose, verify in one step, and stop where it stops paying.

    Scheduler (k from SpecController)  ->  draft slots: a decode computes 1 + k positions
    ModelRunner: Proposer.propose      ->  up to k draft tokens per sequence (ngram / draft)
                 target forward        ->  logits at all 1 + m positions
                 sampling/verify.py    ->  accepted drafts + one target token
    Engine: rollback (KV valid up to the accepted tokens; draft-only blocks given back),
            stats, SpecController.observe_*  (acceptance, step and draft times)

Owns: which requests may speculate (`eligible`) and building a proposer by name.
Never: scheduling (the scheduler asks the controller for k) or finishing sequences.
"""

from __future__ import annotations

from servelm.spec.controller import SpecController
from servelm.spec.proposer import Proposal, Proposer


def eligible(seq) -> bool:
    """Speculation changes neither greedy output nor the sampled distribution, but some
    features are position-by-position over one sampled token and are not verified here:
    penalties (they depend on the drafts before each position), logprobs, min_tokens bans,
    logit_bias, allowed_token_ids and bad words, and seeded sampling (a seed promises the same text whatever the batch; whether a step
    speculates depends on the batch). Those requests decode one token at a time, as does any
    request with `speculative=False`."""
    p = seq.params
    if not getattr(p, "speculative", True):
        return False
    if p.logprobs is not None or seq.num_output_tokens < p.min_tokens:
        return False
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return False
    if p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids:
        return False
    return p.is_greedy or p.seed is None


__all__ = ["Proposal", "Proposer", "SpecController", "eligible"]
