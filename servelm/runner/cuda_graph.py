"""CUDA graphs for decode steps: capture a few batch sizes once, pad, copy inputs, replay.

A decode step of a small model is mostly kernel-launch overhead; replaying a captured graph
launches the whole forward pass at once. Models and the scheduler do not know graphs exist:
the ModelRunner asks `maybe_run(batch)` and falls back to eager when it returns None (a batch
with prefill chunks, more sequences than the largest size, or a longer block table).

    captured sizes   1 2 4 8 16 24 32 ...            a decode batch of 5 replays size 8:
    static buffers   input_ids   [ a b c d e 0 0 0 ]
                     positions   [ . . . . . 0 0 0 ]
                     slot_mapping[ . . . . . -1 -1 -1 ]   padding writes no K/V
                     seq_lens    [ . . . . . 0 0 0 ]      padding reads no K/V (output 0)
                     block_tables[ rows 0..4 copied; rows past a sequence's length are not read ]

Owns: the static input buffers, the captured graphs (one memory pool), bucketing and padding.
Never: changes what a model computes, makes scheduling decisions, or runs prefill in a graph.
The attention backend must build decode metadata over given tensors (`decode_metadata`) and
read nothing else in `forward`; the triton backend does, the torch reference does not.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from servelm.attention import GraphAttentionBackend

from servelm.attention.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # matches servelm.kernels.store_kv.PAD_SLOT (not imported: no triton here)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself): padding
    wastes at most 7 rows, and few graphs keep capture time and memory small."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences; None if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """The tensors every captured graph reads. Filled by copy before each replay."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(max_batch, **long)  # [B]
        self.positions = torch.zeros(max_batch, **long)  # [B]
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT, **long)  # [B]
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32,
                                        device=device)  # [B, max_blocks]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)  # [B]

    def fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode batch of B <= size sequences in; rows B..size become padding."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(PAD_SLOT)
        self.seq_lens[n:size].zero_()

    def batch(self, size: int, block_size: int, attn_metadata) -> ForwardBatch:
        """A ForwardBatch of `size` decodes viewing the static buffers (for capture)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=list(range(size + 1)), context_lens=[0] * size,
            seq_lens=[1] * size, num_decodes=size, block_size=block_size,
            logits_indices=torch.arange(size, device=self.input_ids.device),
            attn_metadata=attn_metadata)


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class TorchCudaGraph:
    """torch.cuda.CUDAGraph, all graphs sharing one memory pool."""

    def __init__(self, pool):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        fn()  # warm-up outside the graph: Triton compiles, allocator settles
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRunner:
    """Decode-only forward passes by graph replay. `maybe_run(batch) -> hidden [B, hidden] |
    None`; the hidden states are a view of a static buffer, valid until the next replay."""

    def __init__(self, model: torch.nn.Module, backend: GraphAttentionBackend,
                 max_batch: int, max_blocks: int,
                 device: torch.device, sizes: list[int] | None = None,
                 make_graph: Callable[[], Graph] | None = None):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention_backend {backend.name!r} does not support CUDA graphs; "
                             "use --attention-backend triton")
        self.model, self.backend = model, backend
        self.block_size = backend.kv_cache.block_size
        self.max_blocks = max_blocks
        self.sizes = sorted(sizes or capture_sizes(max_batch))
        self.static = StaticDecodeInputs(self.sizes[-1], max_blocks, device)
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()

            def make_graph() -> Graph:
                return TorchCudaGraph(pool)
        self._make_graph = make_graph
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller graphs reuse its pool). -> seconds."""
        start = time.perf_counter()
        max_len = self.max_blocks * self.block_size
        for size in reversed(self.sizes):
            splits = self.backend.num_kv_splits(size, max_len)  # fixed for this graph
            meta = self.backend.decode_metadata(self.static.block_tables[:size],
                                                self.static.seq_lens[:size], splits)
            batch = self.static.batch(size, self.block_size, meta)  # all padding: no K/V I/O
            graph = self._make_graph()
            self.outputs[size] = graph.capture(
                lambda b=batch: self.model(b.input_ids, b.positions, b))
            self.graphs[size] = graph
        elapsed = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1fs", len(self.sizes),
                    self.sizes[0], self.sizes[-1], elapsed)
        return elapsed

    @torch.inference_mode()  # as the runner's step; the graphs' tensors are inference tensors
    def maybe_run(self, batch: ForwardBatch) -> torch.Tensor | None:
        if not self.graphs or batch.num_decodes != batch.num_seqs:
            return None
        size = padded_size(batch.num_seqs, self.sizes)
        if size is None or batch.block_tables.shape[1] > self.max_blocks:
            return None
        self.static.fill(batch, size)
        self.graphs[size].replay()
        return self.outputs[size][:batch.num_seqs]


class GraphedModel(torch.nn.Module):
    """The model with decode steps replayed from graphs, for a runner that has no graph hook
    (benchmarks): same call signature, same compute_logits."""

    def __init__(self, model: torch.nn.Module, graphs: CudaGraphRunner):
        super().__init__()
        self.model, self.graphs = model, graphs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        hidden = self.graphs.maybe_run(batch)
        return self.model(input_ids, positions, batch) if hidden is None else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
