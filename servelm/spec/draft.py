"""Draft-model proposer: a cheaper model guesses k tokens, one forward per token.

Two kinds of draft, one code path:
- a separate model (a smaller one with the same tokenizer, or the target quantized): it has
  its own KV cache tensors with as many blocks as the target's, indexed by the SAME block
  tables, so the one BlockManager manages both (a block holds a position's K/V in both
  caches; allocation, prefix sharing, preemption and rollback need no second bookkeeping).
  The draft's KV lags the target's: each proposal first catches the draft up on the tokens
  it has not seen (the prompt, on a sequence's first proposal; after that the last verified
  token or two), then drafts.
- the target's own first L layers plus its final norm and head (early exit). It shares the
  target's weights and KV cache: for positions holding verified tokens the first L layers'
  K/V are the target's own, so it never catches up. Its draft tokens write K/V into those
  layers at positions the verification step then rewrites with the same tokens.

Sampled requests draw each draft from the draft's own distribution q (the request's
temperature, top-k/p, min-p applied to the draft's logits) and hand q to verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.runner.cpu_decode import CpuDecodeStack
from servelm.sampling import draw_tensors, sampling_probs
from servelm.spec.proposer import Proposal, Proposer


@dataclass
class _DraftWork:
    seq: object
    start: int
    tokens: list[int]
    drafts: None = None
    is_sampling: bool = True


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model: torch.nn.Module, backend, block_size: int, device,
                 num_layers: int | None = None, shares_target_kv: bool = False,
                 vocab_size: int | None = None):
        """num_layers: run only the model's first N layers (early exit); shares_target_kv:
        the model and backend are the target's (no catch-up)."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.shares_target_kv = shares_target_kv
        self.vocab_size = vocab_size or model.config.vocab_size
        self._kv_end: dict[int, tuple[int, int]] = {}  # seq_id -> (num_resets, draft KV end)
        # CPU, float32: the draft's decode steps in one C++ call (runner/cpu_decode.py)
        self.stack = CpuDecodeStack.for_model(model, None, backend)

    def release(self, seq_id: int) -> None:
        self._kv_end.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, scheduled: list) -> dict[int, Proposal]:
        from servelm.runner.model_runner import build_forward_batch

        seqs = [s.seq for s in scheduled]
        want = {s.seq.seq_id: s.num_spec for s in scheduled}
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        qs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq in seqs}
        # First forward: catch up to (and including) the last verified token. The attention
        # backends take single-token sequences first: order the works (and rows) so.
        works = [_DraftWork(seq, self._draft_start(seq), seq.token_ids[self._draft_start(seq):])
                 for seq in seqs]
        works.sort(key=lambda w: len(w.tokens) != 1)
        active = [w.seq for w in works]
        for j in range(max(want.values())):
            fb = build_forward_batch(works, self.block_size, self.device)
            logits = self._logits(fb)
            tokens, probs = self._sample(active, logits)
            nxt = []
            for row, seq in enumerate(active):
                drafts[seq.seq_id].append(tokens[row])
                if probs is not None:
                    qs[seq.seq_id].append(probs[row])
                end = seq.num_tokens + j  # draft KV now covers positions < end
                self._kv_end[seq.seq_id] = (seq.num_resets, end)
                if len(drafts[seq.seq_id]) < want[seq.seq_id]:
                    nxt.append(seq)
            active = nxt
            if not active:
                break
            works = [_DraftWork(seq, seq.num_tokens + j, [drafts[seq.seq_id][-1]])
                     for seq in active]
        out = {}
        for seq in seqs:
            q = qs[seq.seq_id]
            out[seq.seq_id] = Proposal(drafts[seq.seq_id], torch.stack(q) if q else None)
        return out

    def _draft_start(self, seq) -> int:
        """First position whose draft K/V is missing or stale."""
        if self.shares_target_kv:
            return seq.num_computed_tokens
        resets, end = self._kv_end.get(seq.seq_id, (-1, 0))
        if resets != seq.num_resets:
            return 0  # never drafted, or preempted since: the blocks are new
        # Positions < end hold the tokens drafted then; those past the verified ones differ.
        return min(end, seq.num_computed_tokens)

    def _logits(self, fb: ForwardBatch) -> torch.Tensor:
        m = self.model
        hidden = self.stack.maybe_run(fb, self.num_layers) if self.stack is not None else None
        if hidden is not None:
            return m.compute_logits(hidden[fb.logits_indices]).float()
        fb.attn_metadata = self.backend.build_metadata(fb)
        hidden = m(fb.input_ids, fb.positions, fb, layers=self.num_layers)
        return m.compute_logits(hidden[fb.logits_indices]).float()

    def _sample(self, seqs: list, logits: torch.Tensor):
        """Greedy rows take the argmax; sampled rows draw from q and keep it."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if not sampled:
            return tokens.tolist(), None
        dev = logits.device
        st = draw_tensors([seqs[i].params for i in sampled], self.vocab_size, dev)
        q = sampling_probs(logits[sampled], st)
        q = q / q.sum(dim=-1, keepdim=True)
        drawn = torch.multinomial(q, 1).squeeze(1)
        tokens[sampled] = drawn
        probs = torch.zeros(len(seqs), logits.shape[1], device=dev)
        probs[sampled] = q
        greedy = [i for i in range(len(seqs)) if i not in set(sampled)]
        if greedy:  # a point mass on the argmax
            probs[greedy, tokens[greedy]] = 1.0
        return tokens.tolist(), probs
