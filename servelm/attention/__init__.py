"""Attention backends, registered by name and imported only when chosen.

A backend owns the attention computation over the paged KV cache and the per-step metadata
it needs; models call `backend.forward(layer, q, k, v, batch)` and know nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class AttentionBackend(Protocol):
    """What every backend implements (TorchAttentionBackend, TritonAttentionBackend). Built
    with (kv_cache, num_heads, scale); `build_metadata` runs once a step, before the model."""

    kv_cache: Any

    def build_metadata(self, batch) -> Any:
        """Per-step metadata from the ForwardBatch (stored as batch.attn_metadata)."""
        ...

    def forward(self, layer: int, q, k, v, batch):
        """Write this step's k/v [T, K, D] into layer's cache at batch.slot_mapping, attend
        q [T, H, D] over each sequence's context; returns [T, H, D]."""
        ...


_BACKENDS = {
    "torch": "servelm.attention.torch_backend:TorchAttentionBackend",
    "triton": "servelm.attention.triton_backend:TritonAttentionBackend",  # imports triton
}


def get_backend_class(name: str):
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention_backend {name!r} is unknown; choose from "
                         f"{sorted(_BACKENDS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
