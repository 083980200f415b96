"""PipelineSchedule: one step's forward through pipeline stages, in micro-batches.

Owns: splitting a step's ForwardBatch into micro-batches of whole sequences (attention reads
only a sequence's own KV, so the split is exact), running this stage's layers on each as it
arrives, passing (hidden, residual) to the next stage without waiting for it to finish, and
giving every rank the last stage's final hidden states (each stage holds the embedding and
the head, so every rank then computes the logits as without stages). Never: changes what a
layer computes, or the order of a sequence's tokens.

Two stages, three micro-batches: stage 1 starts on m0 while stage 0 computes m1 (the
sends are asynchronous), so after the first micro-batch both stages work at once:

    stage 0   [m0][m1][m2]
    stage 1       [m0][m1][m2] -> broadcast hidden [T, hidden] to every rank
"""

from __future__ import annotations

from itertools import pairwise

import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.models.decoder import HiddenState


def split_batch(fb: ForwardBatch, num_micro: int) -> list[tuple[int, int, ForwardBatch]]:
    """[(first token, end token, the micro-batch's own ForwardBatch)], contiguous runs of
    sequences of about equal token counts (decodes stay first within each)."""
    num_seqs, qsl = fb.num_seqs, fb.query_start_loc
    num_micro = max(1, min(num_micro, num_seqs))
    bounds, target = [0], fb.num_tokens / num_micro
    for i in range(1, num_seqs):
        if len(bounds) < num_micro and qsl[i] >= target * len(bounds):
            bounds.append(i)
    bounds.append(num_seqs)
    out = []
    for a, b in pairwise(bounds):
        lo, hi = qsl[a], qsl[b]
        out.append((lo, hi, ForwardBatch(
            input_ids=fb.input_ids[lo:hi], positions=fb.positions[lo:hi],
            slot_mapping=fb.slot_mapping[lo:hi], block_tables=fb.block_tables[a:b],
            query_start_loc=[q - lo for q in qsl[a:b + 1]],
            context_lens=fb.context_lens[a:b], seq_lens=fb.seq_lens[a:b],
            num_decodes=max(0, min(fb.num_decodes, b) - a), block_size=fb.block_size,
            logits_indices=fb.logits_indices)))
    return out


class PipelineSchedule:
    """This rank's stage: model.layers are the stage's layers (renumbered from 0)."""

    def __init__(self, group, num_micro_batches: int | None = None):
        self.group = group
        self.num_micro = num_micro_batches or group.num_stages

    def run(self, model, positions: torch.Tensor, batch: ForwardBatch,
            hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The final hidden states [T, hidden] of the whole model, on every rank."""
        if batch.lora is not None or batch.mm is not None:
            raise ValueError("LoRA and image inputs do not run through pipeline stages")
        g, backend = self.group, _backend(model)
        sends, outs = [], []
        for lo, hi, mb in split_batch(batch, self.num_micro):
            mb.attn_metadata = backend.build_metadata(mb)
            hidden_in = None
            if not g.is_first_stage:
                hidden_in = HiddenState(g.recv_prev((hi - lo, hidden_size), dtype),
                                        g.recv_prev((hi - lo, hidden_size), dtype))
            out = model(mb.input_ids, positions[lo:hi], mb, hidden_in=hidden_in,
                        final_norm=g.is_last_stage)
            if g.is_last_stage:
                outs.append(out)
            else:
                sends += [g.send_next(out.x), g.send_next(out.residual)]
        for req in sends:
            req.wait()
        hidden = (torch.cat(outs) if g.is_last_stage else
                  torch.empty(batch.num_tokens, hidden_size, dtype=dtype,
                              device=positions.device))
        return g.broadcast_from_last_stage(hidden.contiguous())


def _backend(model):
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None:
            return backend
    raise ValueError("pipeline stage: no attention backend bound to the model")
