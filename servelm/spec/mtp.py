"""MTP drafting: DeepSeek-V3's own multi-token-prediction module as the drafter, chained.

    target step (eager)  ->  the hidden state after its last layer, through the target's
                             final norm: h_i (what predicted token i + 1)
    drafter position i:      MultiTokenPredictor(h_i, embed(t_{i+1}))  ->  out_i (normed)
                             draft = argmax head(out_i)            (predicts token i + 2)
    chain step j > 0:        (out of the step before, embed(draft j)), the same module again

Owns: the MTP drafter (MTPDrafter: the module servelm/models/deepseek.py builds from the
checkpoint, the target's embedding and head, an MLA backend over one sequence's own cache).
The proposer, per-sequence features and KV, and the chain are servelm/spec/chain.py's.
Never: loading tensors (models/deepseek.py: build_mtp), the target's forward, verification.

Choices, and why:
- h_i is the target's final-normed hidden state (the lm_head's input), as vLLM's and SGLang's
  MTP drafters take it; the runner hands over the last layer's stream (x + residual,
  `aux_layers`) and the target's own final norm is applied here. A chain step feeds back
  the module's output after shared_head.norm (the head's input), as SGLang does.
- One module, however many the checkpoint has (DeepSeek-V3 ships one): k drafts are k runs
  of it. Its KV is the module's MLA entries ([latent | rope key], one per position).
- No masking of the embedding at position 0 (vLLM zeroes it; the paper's formula and SGLang
  do not). The drafter's choices change only what is accepted, never the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelm.spec.chain import ChainProposer, SeqKV, causal_mask

logger = logging.getLogger(__name__)


class UnsupportedMTPError(ValueError):
    """A target servelm cannot draft for with --speculative-method mtp, named."""


@dataclass(frozen=True)
class _DraftBatch:
    """The MTP layer's view of a step: every position is a chunk's (no absorbed decode)."""

    num_decodes: int = 0


class SeqMLABackend:
    """The MTP layer's attention backend: MLA over one sequence's own cache (`cache`, set by
    the drafter before each step), computed explicitly (keys and values up-projected)."""

    def __init__(self):
        self.cache: SeqKV | None = None

    def forward_mla(self, layer: int, entry: torch.Tensor, batch, q_decode: torch.Tensor,
                    q_prefill: torch.Tensor, expand, scale: float, latent_dim: int):
        """entry [T, L+R] appended to the cache; q_prefill [T, H, Dk] -> [T, H, Dv]."""
        cache = self.cache
        cache.append(entry[:, None], entry[:, None, :0])
        keys, values = expand(cache.k[:, 0])  # [C, H, Dk], [C, H, Dv]
        mask = causal_mask(q_prefill.shape[0], keys.shape[0], keys.device)
        out = F.scaled_dot_product_attention(q_prefill.transpose(0, 1), keys.transpose(0, 1),
                                             values.transpose(0, 1), attn_mask=mask,
                                             scale=scale)
        return q_decode.new_empty(0, q_prefill.shape[1], latent_dim), out.transpose(0, 1)


class MTPDrafter:
    """The chain proposer's drafter (servelm/spec/chain.py) over a MultiTokenPredictor."""

    def __init__(self, target, mtp, backend: SeqMLABackend):
        self.target = target
        self.mtp = mtp
        self.backend = backend
        c = target.config
        self.aux_layers = (c.num_layers - 1,)
        self._entry_dim = c.kv_lora_rank + c.qk_rope_head_dim
        self._batch = _DraftBatch()

    def features(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.target.norm(aux[0])  # the target's final norm: the head's input

    def new_cache(self, start: int) -> SeqKV:
        w = self.mtp.eh_proj.weight
        return SeqKV(start, 1, self._entry_dim, 0, w.dtype, w.device)

    def step(self, hidden, tokens, positions, cache: SeqKV) -> torch.Tensor:
        self.backend.cache = cache
        try:
            return self.mtp(hidden, self.target.embed(tokens), positions, self._batch)
        finally:
            self.backend.cache = None

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        head = self.mtp.shared_head_head
        return head(out) if head is not None else self.target.compute_logits(out)

    def next_tokens(self, out: torch.Tensor) -> torch.Tensor:
        return self.logits(out).argmax(-1)


class MTPProposer(ChainProposer):
    name = "mtp"


def check_mtp_target(config) -> None:
    """Refuse, by name, a model whose checkpoint has no MTP module servelm can run."""
    from servelm.models import get_model_class

    has_build = hasattr(get_model_class(config.architecture), "build_mtp")
    if not (has_build and config.num_mtp_layers > 0):
        raise UnsupportedMTPError(
            f"speculative method 'mtp' needs a model with multi-token-prediction layers "
            f"(DeepSeek-V3's num_nextn_predict_layers > 0); {config.name or 'the model'} "
            f"({config.architecture}) has none")


def split_mtp_tensors(weights, config) -> tuple[object, list]:
    """(the stream without the MTP modules' tensors, the list the first module's are put
    in as the stream is read): the model's load never sees them, nothing is read twice."""
    from servelm.models.deepseek import mtp_module_index

    taken: list = []

    def rest():
        for name, tensor in weights:
            index = mtp_module_index(name, config)
            if index is None:
                yield name, tensor
            elif index == 0:  # later modules are not used: dropped as they pass
                taken.append((name, tensor))

    return rest(), taken


def build_mtp_proposer(target, mtp_tensors) -> MTPProposer:
    """The proposer for `target` (a DeepSeek model) from its checkpoint's MTP tensors."""
    check_mtp_target(target.config)
    c = target.config
    backend = SeqMLABackend()
    try:
        mtp = target.build_mtp(mtp_tensors, backend)
    except ValueError as e:
        raise UnsupportedMTPError(str(e)) from e
    if isinstance(mtp_tensors, list):
        mtp_tensors.clear()  # copied into the module: the checkpoint's tensors can go
    logger.info("mtp drafter: the checkpoint's multi-token-prediction module %d of %d "
                "(%s head), chained", 0, c.num_mtp_layers,
                "its own" if mtp.shared_head_head is not None else "the model's")
    return MTPProposer(MTPDrafter(target, mtp, backend))
