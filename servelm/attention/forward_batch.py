"""ForwardBatch: the only metadata a model's forward pass sees.

Sequences are laid out flat, decodes first:

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1]      3 decodes, 2 prefill chunks
    query_start_loc: [0, 1, 2, 3, 8, 11]
    context_lens:    tokens before this step, per sequence
    seq_lens:        context_lens + query lens (what attention reads)
    slot_mapping:    where each new token's K/V is written: block * block_size + offset

The runner builds it (runner/model_runner.py build_forward_batch); it lives here, below the
models, so that models/, attention/ and layers/ never import runner/ (tests/test_layering.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    logits_indices: torch.Tensor  # [S] flat positions whose hidden state is sampled
    attn_metadata: Any = field(default=None)  # built once per step by the attention backend
    # servelm.lora.segmented.LoraBatch when some rows use a LoRA adapter; None: the base path
    lora: Any = field(default=None)
    # servelm.vision.runner.MultimodalBatch when rows take image embeddings (or M-RoPE
    # positions); None: token embeddings and 1-D positions only
    mm: Any = field(default=None)
    # batch index -> [Q, Q] bool: that sequence's rows are a speculative tree's (each sees
    # its ancestors; attention/tree_mask.py); None: every sequence causal
    tree_masks: dict | None = field(default=None)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]
