"""Chain drafting from the target's own hidden states: the proposer shared by every drafter
that reads them (EAGLE-3's head, DeepSeek-V3's multi-token-prediction module).

    target step (eager, aux_layers)  ->  observe: drafter.features(aux) kept per sequence
    propose:  catch the drafter up on the positions the target computed since (their
              features and the next real tokens), then k chain steps, each feeding the
              drafter's own output back with the token it drafted

A drafter gives: `aux_layers` (the target layers it reads), `features(aux) -> [T, H]`,
`new_cache(start)` (its KV for one sequence, a SeqKV), `step(hidden, tokens, positions,
cache) -> out [T, H]` (appends the positions' K/V to the cache) and `next_tokens(out) ->
target ids`.

Owns: per sequence, the features not yet consumed and the drafter's KV; the chain.
Never: the target's forward (the runner runs it with `aux_layers` and calls `observe`),
verification, or the block manager.

Why the drafter's KV is its own small contiguous cache per sequence, not the paged cache: the
drafter can only compute a position once the target has, so blocks shared through the prefix
cache would hold drafter KV that no sequence computed. A sequence's drafter context starts at
the first position whose target features it saw (a prefix-cache hit's earlier positions are
not in it); positions stay absolute. Drafted (chain) positions' KV is dropped after each
proposal: the next one recomputes them from the target's features. Drafts are the drafter's
argmax and reach verification as point masses (like n-gram's), so greedy output is plain
decoding's and sampled requests keep the target's distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.spec.proposer import Proposal, Proposer


class SeqKV:
    """One sequence's drafter K/V for positions start .. start + len - 1: k [N, K, D],
    v [N, K, Dv] (Dv may be 0: an MLA entry keeps its values inside k)."""

    def __init__(self, start: int, num_kv_heads: int, head_dim: int, v_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device=None):
        self.start = start
        self.k = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(0, num_kv_heads, head_dim if v_dim is None else v_dim,
                             dtype=dtype, device=device)

    @property
    def end(self) -> int:
        return self.start + self.k.shape[0]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = torch.cat((self.k, k)), torch.cat((self.v, v))

    def truncate(self, end: int) -> None:
        self.k, self.v = self.k[:end - self.start], self.v[:end - self.start]

    def restart(self, start: int) -> None:
        self.start, self.k, self.v = start, self.k[:0], self.v[:0]


def causal_mask(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """[Q, C]: query j (the last Q of the C cached positions) sees keys up to its own."""
    keys = torch.arange(num_keys, device=device)
    return keys[None, :] <= torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]


@dataclass
class _SeqState:
    num_resets: int
    kv: SeqKV
    feat_start: int = 0  # features for positions feat_start .. + len
    feat: torch.Tensor | None = None
    # a tree verified last step: (start, its rows' features, drafts, parents), resolved to
    # the accepted path's features once the sequence's new tokens are known
    pending: tuple | None = None


class ChainProposer(Proposer):
    """Drafts k tokens per sequence as a chain of `drafter` steps (module docstring)."""

    name = "chain"

    def __init__(self, drafter):
        self.drafter = drafter
        self.aux_layers = tuple(drafter.aux_layers)
        self._seqs: dict[int, _SeqState] = {}

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _state(self, seq) -> _SeqState:
        st = self._seqs.get(seq.seq_id)
        if st is None or st.num_resets != seq.num_resets:
            st = self._seqs[seq.seq_id] = _SeqState(seq.num_resets, self.drafter.new_cache(0))
        return st

    @torch.inference_mode()
    def observe(self, works: list, query_start_loc: list[int], aux: list[torch.Tensor]) -> None:
        """The target computed `works` (rows query_start_loc[i] ..): keep their features.
        Rows past the verified tokens (rejected drafts) are replaced the next time."""
        feats = self.drafter.features(aux)  # [T, H]
        for i, w in enumerate(works):
            self._keep(self._state(w.seq), w.start,
                       feats[query_start_loc[i]:query_start_loc[i + 1]])

    @staticmethod
    def _keep(st: _SeqState, start: int, rows: torch.Tensor) -> None:
        """rows: the features of positions start .. start + len - 1."""
        end = st.feat_start + (0 if st.feat is None else st.feat.shape[0])
        if st.feat is None or not st.feat_start <= start <= end:
            st.feat_start, st.feat = start, rows  # a gap (prefix hit) or a restart
        else:
            st.feat = torch.cat((st.feat[:start - st.feat_start], rows))

    @torch.inference_mode()
    def propose(self, scheduled: list) -> dict[int, Proposal]:
        out = {}
        for s in scheduled:
            drafts = self._chain(s.seq, s.start, s.num_spec)
            if drafts:
                out[s.seq.seq_id] = Proposal(drafts)
        return out

    def _chain(self, seq, start: int, k: int) -> list[int]:
        """Catch the drafter up, then draft k tokens for positions start + 1 ..."""
        st = self._state(seq)
        out = self._catch_up(st, seq, start)
        if out is None:
            return []
        kv, device = st.kv, out.device
        real_end = kv.end
        drafts = []
        for j in range(k):
            d = int(self.drafter.next_tokens(out)[0])
            drafts.append(d)
            if j + 1 < k:
                out = self.drafter.step(out, torch.tensor([d], device=device),
                                        torch.tensor([start + j], device=device), kv)
        self._finish(st, start, real_end)
        return drafts

    def _catch_up(self, st: _SeqState, seq, start: int) -> torch.Tensor | None:
        """Run the drafter over positions < start whose target features it has not used:
        -> its output at position start - 1 [1, H] (what drafts position start + 1), or
        None when the features do not reach start."""
        kv = st.kv
        if st.feat is None:
            return None
        if not st.feat_start <= kv.end <= start:  # features begin later (a prefix hit)
            kv.restart(st.feat_start)
        if kv.end >= start or st.feat_start + st.feat.shape[0] < start:
            return None
        lo = kv.end
        device = st.feat.device
        hidden = st.feat[lo - st.feat_start:start - st.feat_start]
        tokens = torch.tensor(seq.token_ids[lo + 1:start + 1], device=device)
        positions = torch.arange(lo, start, device=device)
        return self.drafter.step(hidden, tokens, positions, kv)[-1:]

    @staticmethod
    def _finish(st: _SeqState, start: int, real_end: int) -> None:
        """Drop the drafted positions' KV and the features already consumed."""
        st.kv.truncate(real_end)
        st.feat_start, st.feat = start, st.feat[start - st.feat_start:]
