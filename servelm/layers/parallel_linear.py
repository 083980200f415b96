"""Tensor-parallel layers: how a family's dense layers run split over `size` ranks.

Owns: the vocabulary-parallel embedding and output head, the all-reduce after each layer's
attention and MLP (the row-parallel halves), and `TensorParallelModel`, the wrapper a rank's
model runs in. Never: opens a checkpoint or picks a rank's slice of a tensor (that is
servelm/parallel/sharding.py), or creates a process group (servelm/parallel/group.py).

A linear y = x W^T with W [N, K] splits two ways; a transformer layer pairs them so that one
all-reduce per block suffices (Megatron's scheme):

    column-parallel  W by output rows: rank r computes y_r = x W_r^T, its own heads (q/k/v)
                     or its slice of the MLP width (gate/up); nothing to communicate
    row-parallel     W by input columns: rank r computes x_r W_r^T, a partial sum over its
                     heads / its MLP slice; y = sum over ranks: one all-reduce (o_proj, down)

A column-parallel linear is an ordinary linear over a rank's rows (the family builds it from
the rank's local ModelConfig: fewer heads, a narrower MLP), so quantized and packed linears
shard with no change. The row-parallel all-reduce is a forward hook on the block that ends
in the row-parallel linear (`self_attn`, `mlp`): everything after o_proj / down_proj inside
the block is linear (a MoE's routing weights, a shared expert's sigmoid gate), so reducing
the block's output equals reducing the projection's. A bias on a row-parallel linear is
loaded on rank 0 only, so the sum adds it once.

Where reductions reorder (why TP logits differ from TP=1 in the last float32 bits): the
all-reduce sums `size` partial products whose terms the unsplit GEMM would have summed in
its own blocked order; the embedding all-reduce adds zeros only (exact); the head's
all-gather concatenates (exact).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Collectives(Protocol):
    """What a tensor-parallel layer needs from its group (servelm/parallel/group.py)."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows per rank) of a vocabulary split in `size` equal, padded parts: the
    last rank's tail past vocab_size is zero rows (their logits are cut after the gather)."""
    per = -(-vocab_size // size)
    return rank * per, per


class VocabParallelEmbedding(nn.Module):
    """A rank's rows [start, start + per) of the embedding: ids outside them look up zeros,
    and the all-reduce fills every row from the rank that holds it."""

    def __init__(self, local: nn.Embedding, start: int, comm: Collectives):
        super().__init__()
        self.weight = local.weight  # the same Parameter: state_dict names are unchanged
        self.start, self.num_local = start, local.weight.shape[0]
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


def _reduce_hook(comm: Collectives):
    def hook(module, args, out):
        return comm.all_reduce(out)
    return hook


def install_reductions(model: nn.Module, comm: Collectives) -> int:
    """The all-reduce after each layer's attention and MLP (each ends in a row-parallel
    linear). An MLP whose experts are placed by expert parallelism combines its own output
    (servelm/layers/parallel_moe.py) and gets none. Returns the hooks installed."""
    from servelm.layers.parallel_moe import ExpertParallelExperts

    n = 0
    for layer in model.layers:
        layer.self_attn.register_forward_hook(_reduce_hook(comm))
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, ExpertParallelExperts):
            layer.mlp.register_forward_hook(_reduce_hook(comm))
            n += 1
        n += 1
    return n


class TensorParallelModel(nn.Module):
    """One rank's model: the family's model over its local shapes, with the vocabulary-parallel
    embedding, the reductions, and logits gathered from every rank's vocabulary slice.

    The runner calls it as it calls any model: forward(input_ids, positions, batch) and
    compute_logits(hidden) -> [T, vocab_size] (the full vocabulary on every rank)."""

    def __init__(self, model: nn.Module, vocab_size: int, comm: Collectives, pipeline=None):
        """pipeline: a servelm/parallel/pipeline.PipelineSchedule when the model is one
        pipeline stage (its layers the stage's): forward then runs the stages."""
        super().__init__()
        start, _ = vocab_shard(vocab_size, comm.rank, comm.size)
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, start, comm)
        self.num_reductions = install_reductions(model, comm)
        self.model = model
        self.config = model.config
        self.vocab_size = vocab_size
        self.comm = comm
        self.pipeline = pipeline

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch,
                **kwargs) -> torch.Tensor:
        """kwargs: the family model's (DecoderLM.forward: layers, ...)."""
        if self.pipeline is not None:
            if kwargs:
                raise ValueError(f"{sorted(kwargs)}: a forward through pipeline stages runs "
                                 "every layer (no early exit)")
            return self.pipeline.run(self.model, positions, batch, self.config.hidden_size,
                                     self.model.embed_tokens.weight.dtype)
        return self.model(input_ids, positions, batch, **kwargs)

    def fast_path(self):
        """The family model's (its shard's) decode-stack form."""
        return self.model.fast_path()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Local logits [T, V/size] (soft-capped where the family caps: elementwise, so
        before the gather), gathered to [T, V]."""
        local = self.model.compute_logits(hidden)
        return self.comm.all_gather(local.contiguous(), dim=-1)[..., :self.vocab_size]
