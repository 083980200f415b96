"""Attention backends, registered by name and imported only when chosen.

A backend owns the attention computation over the paged KV cache and the per-step metadata
it needs. `AttentionBackend` is everything its callers use: the models (`forward` with its
variants, `forward_mla`), the runner (`build_metadata`, deterministic mode, the cache and
scale the C++ decode stack reads) and, in `GraphAttentionBackend`, the CUDA-graph runner's
decode metadata over static buffers. Models, runner and graph runner are typed against these
protocols, never against a backend class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from servelm.attention.forward_batch import ForwardBatch
    from servelm.attention.kv_cache import KVCache


@runtime_checkable
class AttentionBackend(Protocol):
    """What every backend implements (TorchAttentionBackend, TritonAttentionBackend). Built
    with (kv_cache, num_heads, scale); `build_metadata` runs once a step, before the model."""

    name: str
    kv_cache: KVCache
    scale: float  # of q.k: 1/sqrt(head_dim)
    # forward takes window= and softcap=; a model needing either refuses a backend without
    supports_variants: bool
    supports_cuda_graphs: bool  # implements GraphAttentionBackend
    # the C++ paged decode kernel over kv_cache (CPU), which the C++ decode stack calls;
    # None: the backend has none, and the stack does not apply
    decode_kernel: Any | None

    @property
    def deterministic(self) -> bool:
        """Whether every query token is attended as one row (--deterministic)."""
        ...

    def set_deterministic(self) -> None:
        """From now on, batch-invariant attention: a row's result never depends on its step."""
        ...

    def build_metadata(self, batch: ForwardBatch) -> Any:
        """Per-step metadata from the ForwardBatch (stored as batch.attn_metadata)."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Write this step's k/v [T, K, D] into layer's cache at batch.slot_mapping, attend
        q [T, H, D] over each sequence's context; returns [T, H, D]. window: the last
        `window` positions only (0: all); softcap: scores -> c * tanh(scores / c) (0: off);
        both only where supports_variants."""
        ...

    def forward_mla(self, layer: int, entry: torch.Tensor, batch: ForwardBatch,
                    q_decode: torch.Tensor, q_prefill: torch.Tensor,
                    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                    scale: float, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head latent attention over a cache of [latent | rope key] entries
        (KVCache.is_mla): the decodes' latent outputs and the prefills' outputs
        (models/deepseek.py)."""
        ...


@runtime_checkable
class GraphAttentionBackend(AttentionBackend, Protocol):
    """A backend whose decode steps a CUDA graph can capture (runner/cuda_graph.py): its
    decode metadata is built over given tensors (a graph's static buffers), and forward
    reads nothing else."""

    def num_kv_splits(self, num_decodes: int, max_seq_len: int) -> int:
        """Splits of each sequence's context for a decode batch of this shape."""
        ...

    def decode_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        num_kv_splits: int) -> Any:
        """Metadata for decodes only, over these tensors as given (not copied)."""
        ...


_BACKENDS = {
    "torch": "servelm.attention.torch_backend:TorchAttentionBackend",
    "triton": "servelm.attention.triton_backend:TritonAttentionBackend",  # imports triton
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention_backend {name!r} is unknown; choose from "
                         f"{sorted(_BACKENDS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
